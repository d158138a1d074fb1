"""The terminal websocket (/ws/interactive/<job>/terminal/, portal.terminal):
who gets in, what it relays to the node's agent group and back, and its bounds
(real channels_redis on Redis, PostgreSQL; the agent's side is a listener on
its group)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.contrib.auth.models import Permission
from django.db import connections
from django.test import Client

from portal.asgi import application
from portal.idle import activity
from portal.terminal import consumers
from scheduler import events
from scheduler.models import Job, JobEvent
from tests.conftest import make_node
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.anyio, pytest.mark.django_db(transaction=True)]

TIMEOUT = 5
GOOD_ORIGIN = (b"origin", b"http://localhost")


@pytest.fixture(autouse=True)
async def _close_db_connections() -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


def session(user: User) -> tuple[bytes, bytes]:
    client = Client()
    client.force_login(user)
    value = client.cookies[django_settings.SESSION_COOKIE_NAME].value
    return (b"cookie", f"{django_settings.SESSION_COOKIE_NAME}={value}".encode())


login = database_sync_to_async(session)


def running_shell_job(owner: User) -> tuple[Job, int, int]:
    """A running interactive terminal job: (job, its attempt id, node id)."""
    node, _ = make_node(f"n-{owner.pk}", gpus=1)
    job = JobFactory(owner=owner, interactive="shell")
    attempt = start_job(job, node)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    job.refresh_from_db()
    return job, attempt.pk, node.pk


async def agent_listener(node_id: int) -> str:
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(events.agent_group(node_id), channel)
    return str(channel)


async def next_frame(channel: str, *, opens: bool = False) -> dict[str, Any]:
    """The next frame sent to the agent; an open sent again (the consumer
    repeats it until the agent answers) is skipped unless ``opens``."""
    while True:
        event = await asyncio.wait_for(get_channel_layer().receive(channel), TIMEOUT)
        assert event["type"] == "agent.terminal"
        frame: dict[str, Any] = event["frame"]
        if opens or frame["type"] != "terminal.open":
            return frame


async def viewer(job_id: int, *headers: tuple[bytes, bytes]) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(
        application, f"/ws/interactive/{job_id}/terminal/", headers=list(headers)
    )
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    return comm


async def test_it_relays_between_the_viewer_and_the_agent(alice: User) -> None:
    job, attempt_id, node_id = await database_sync_to_async(running_shell_job)(alice)
    agent = await agent_listener(node_id)
    comm = await viewer(job.pk, await login(alice), GOOD_ORIGIN)
    await comm.send_json_to({"type": "open", "cols": 100, "rows": 30})
    opened = await comm.receive_json_from(TIMEOUT)
    terminal_id = opened["terminal"]
    assert opened == {"type": "opened", "terminal": terminal_id}
    assert consumers.terminal_id_is_for(terminal_id, attempt_id)
    assert not consumers.terminal_id_is_for(terminal_id, attempt_id + 1)
    frame = await next_frame(agent, opens=True)
    assert frame["type"] == "terminal.open"
    assert frame["data"]["terminal_id"] == terminal_id
    assert (frame["data"]["attempt_id"], frame["data"]["job_id"]) == (
        attempt_id,
        job.pk,
    )
    assert (frame["data"]["cols"], frame["data"]["rows"]) == (100, 30)

    # Typed before the agent answered: held (the agent may not know the
    # terminal yet), then sent in order once it answers.
    await comm.send_json_to({"type": "input", "data": "early\r"})
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(next_frame(agent), 0.5)
    group = events.terminal_group(terminal_id)
    layer = get_channel_layer()
    await layer.group_send(
        group, {"type": "terminal.output", "data": "$ ", "replay": False, "n": 1}
    )
    assert (await comm.receive_json_from(TIMEOUT))["data"] == "$ "
    assert (await next_frame(agent))["data"]["data"] == "early\r"
    await comm.send_json_to({"type": "input", "data": "ls\r"})
    await comm.send_json_to({"type": "resize", "cols": 120, "rows": 40})
    assert (await next_frame(agent))["data"] == {
        "terminal_id": terminal_id,
        "data": "ls\r",
    }
    resize = await next_frame(agent)
    assert (resize["type"], resize["data"]["cols"]) == ("terminal.resize", 120)
    # The keystrokes are the job's use, which the idle culling counts.
    used = await database_sync_to_async(activity.last_used)([job.pk])
    assert list(used) == [job.pk]
    # A bad message is named; the socket stays usable.
    await comm.send_json_to({"type": "resize", "cols": 0, "rows": 40})
    error = await comm.receive_json_from(TIMEOUT)
    assert error["type"] == "error"
    assert "cols" in error["message"]

    # The agent's output comes back; a gap in its count is marked.
    await layer.group_send(
        group, {"type": "terminal.output", "data": "one", "replay": False, "n": 2}
    )
    assert await comm.receive_json_from(TIMEOUT) == {
        "type": "output",
        "data": "one",
        "replay": False,
    }
    await layer.group_send(
        group, {"type": "terminal.output", "data": "four", "replay": False, "n": 4}
    )
    got = await comm.receive_json_from(TIMEOUT)
    assert got["data"] == consumers.SKIPPED + "four"
    await layer.group_send(group, {"type": "terminal.exit", "code": 3, "message": ""})
    assert await comm.receive_json_from(TIMEOUT) == {
        "type": "exit",
        "code": 3,
        "message": "",
    }
    closed = await comm.receive_output(TIMEOUT)
    assert closed == {"type": "websocket.close", "code": 1000}


async def test_others_get_nothing(alice: User, bob: User, admin_user: User) -> None:
    job, _, _ = await database_sync_to_async(running_shell_job)(alice)
    for headers in (
        [await login(bob), GOOD_ORIGIN],
        [GOOD_ORIGIN],
        [await login(admin_user), GOOD_ORIGIN],
    ):
        comm = await viewer(job.pk, *headers)
        assert await comm.receive_output(TIMEOUT) == {
            "type": "websocket.close",
            "code": consumers.CLOSE_NOT_FOUND,
        }
        await comm.disconnect()
    # A session from another site (no Origin of ours) is not even accepted.
    comm = WebsocketCommunicator(
        application,
        f"/ws/interactive/{job.pk}/terminal/",
        headers=[await login(alice), (b"origin", b"http://evil.example")],
    )
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert not connected

    # Staff with the permission get in, and it is recorded on the job.
    @database_sync_to_async
    def grant() -> None:
        admin_user.user_permissions.add(
            Permission.objects.get(codename="open_any_interactive")
        )

    await grant()
    comm = await viewer(job.pk, await login(admin_user), GOOD_ORIGIN)
    await comm.send_json_to({"type": "open"})
    assert (await comm.receive_json_from(TIMEOUT))["type"] == "opened"
    await comm.disconnect()
    recorded = await database_sync_to_async(
        lambda: list(JobEvent.objects.filter(job=job).values_list("message", flat=True))
    )()
    assert f"terminal opened by {admin_user.get_username()} (staff)" in recorded


async def test_a_flood_of_input_is_dropped_with_an_error(
    alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The allowance's clock stands still: no refill while the flood is read.
    monkeypatch.setattr(consumers.TerminalConsumer, "_now", staticmethod(lambda: 0.0))
    job, _, node_id = await database_sync_to_async(running_shell_job)(alice)
    agent = await agent_listener(node_id)
    comm = await viewer(job.pk, await login(alice), GOOD_ORIGIN)
    await comm.send_json_to({"type": "open"})
    opened = await comm.receive_json_from(TIMEOUT)
    await next_frame(agent, opens=True)
    await get_channel_layer().group_send(
        events.terminal_group(opened["terminal"]),
        {"type": "terminal.output", "data": "$ ", "replay": False, "n": 1},
    )
    await comm.receive_json_from(TIMEOUT)
    burst = int(consumers.MAX_MESSAGES_PER_S * consumers.BURST_S)
    for _ in range(burst + 50):
        await comm.send_json_to({"type": "input", "data": "y"})
    # The consumer reads the whole flood before it answers: a generous bound,
    # since a loaded machine takes several seconds for 450 frames.
    error = await comm.receive_json_from(60)
    assert error["type"] == "error"
    assert "input dropped" in error["message"]
    relayed = 0
    while True:
        try:
            frame = await next_frame(agent)
        except TimeoutError:
            break
        relayed += frame["type"] == "terminal.input"
        if relayed == burst:
            break
    # Exactly the allowance (the open took one message of it).
    assert relayed == burst - 1 or relayed == burst
    await comm.disconnect()


async def test_a_viewer_deactivated_by_the_directory_is_signed_out(alice: User) -> None:
    """A removal at the directory or identity provider closes the open terminal
    (4401, as the live pages); the agent is told the viewer left."""
    from portal.directory.identity import deactivate_user

    job, _, node_id = await database_sync_to_async(running_shell_job)(alice)
    agent = await agent_listener(node_id)
    comm = await viewer(job.pk, await login(alice), GOOD_ORIGIN)
    await comm.send_json_to({"type": "open", "cols": 80, "rows": 24})
    assert (await comm.receive_json_from(TIMEOUT))["type"] == "opened"
    assert (await next_frame(agent, opens=True))["type"] == "terminal.open"

    await database_sync_to_async(deactivate_user)(alice, "removed from the directory")

    closed = await comm.receive_output(TIMEOUT)
    assert closed == {"type": "websocket.close", "code": 4401}
    await comm.disconnect()  # the browser's side of the closing handshake
    left = await next_frame(agent)
    assert (left["type"], left["data"]["detach"]) == ("terminal.close", True)
