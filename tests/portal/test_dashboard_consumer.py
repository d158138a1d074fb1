"""The browser dashboard websocket (/ws/dashboard/): session auth, Origin check,
subscriptions limited to what the user may see, clear errors for bad messages,
rate limits, and the live updates a subscribed tab gets from a real agent
connection (channels_redis on real Redis, PostgreSQL)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.db import connections
from django.test import Client

from agents import protocol
from portal import consumers
from portal.asgi import application
from scheduler import events, live
from tests.conftest import make_node
from tests.factories import JobFactory, agent_frame, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Job, Node

pytestmark = [pytest.mark.anyio, pytest.mark.django_db(transaction=True)]

TIMEOUT = 5
GOOD_ORIGIN = (b"origin", b"http://localhost")


@pytest.fixture(autouse=True)
async def _close_db_connections(clean_live: None) -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


def session_cookie(user: User) -> tuple[bytes, bytes]:
    client = Client()
    client.force_login(user)
    value = client.cookies[django_settings.SESSION_COOKIE_NAME].value
    return (b"cookie", f"{django_settings.SESSION_COOKIE_NAME}={value}".encode())


@pytest.fixture
def cookies(
    alice: User, bob: User, charlie: User, admin_user: User
) -> dict[str, tuple[bytes, bytes]]:
    """A session cookie header per persona (logging in touches the database)."""
    users = {"alice": alice, "bob": bob, "charlie": charlie, "admin": admin_user}
    return {name: session_cookie(user) for name, user in users.items()}


@pytest.fixture
def alice_job(alice: User) -> Job:
    return JobFactory(owner=alice)


async def dashboard(*headers: tuple[bytes, bytes]) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(application, "/ws/dashboard/", headers=list(headers))
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    return comm


async def subscribe(comm: WebsocketCommunicator, job_id: int) -> dict[str, Any]:
    await comm.send_json_to({"subscribe": "job", "id": job_id})
    return await comm.receive_json_from(timeout=TIMEOUT)


async def broadcast(job_id: int, status: str, message: str) -> None:
    await database_sync_to_async(events.broadcast_job_status)(job_id, status, message)


async def test_it_closes_an_unauthenticated_connection(transactional_db: None) -> None:
    comm = WebsocketCommunicator(application, "/ws/dashboard/", headers=[GOOD_ORIGIN])

    connected, code = await comm.connect(timeout=TIMEOUT)

    assert connected is False
    assert code == 4401


async def test_it_rejects_a_foreign_origin(cookies: dict[str, Any]) -> None:
    cookie = cookies["alice"]
    comm = WebsocketCommunicator(
        application,
        "/ws/dashboard/",
        headers=[cookie, (b"origin", b"http://evil.example")],
    )

    connected, _ = await comm.connect(timeout=TIMEOUT)

    assert connected is False


async def test_it_sends_the_owner_her_jobs_status(
    cookies: dict[str, Any], alice_job: Job
) -> None:
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)

    reply = await subscribe(comm, alice_job.pk)
    await broadcast(alice_job.pk, "running", "running on node-a")
    update = await comm.receive_json_from(timeout=TIMEOUT)

    assert reply == {"subscribed": f"job.{alice_job.pk}"}
    assert update == {
        "type": "job.status",
        "job_id": alice_job.pk,
        "status": "running",
        "message": "running on node-a",
    }
    await comm.disconnect()


@pytest.mark.parametrize("persona", ["bob", "charlie"])
async def test_it_refuses_a_subscription_to_someone_elses_job(
    request: pytest.FixtureRequest,
    cookies: dict[str, Any],
    alice_job: Job,
    persona: str,
) -> None:
    other: User = request.getfixturevalue(persona)
    own_job = await database_sync_to_async(JobFactory)(owner=other)
    comm = await dashboard(cookies[persona], GOOD_ORIGIN)

    refused = await subscribe(comm, alice_job.pk)
    await subscribe(comm, own_job.pk)
    await broadcast(alice_job.pk, "running", "alice's secret")
    await broadcast(own_job.pk, "running", "mine")
    first = await comm.receive_json_from(timeout=TIMEOUT)

    assert refused == {"error": "no such job"}
    assert first["job_id"] == own_job.pk  # alice's update never arrived
    await comm.disconnect()


async def test_it_lets_staff_watch_any_job(
    cookies: dict[str, Any], alice_job: Job
) -> None:
    comm = await dashboard(cookies["admin"], GOOD_ORIGIN)

    reply = await subscribe(comm, alice_job.pk)

    assert reply == {"subscribed": f"job.{alice_job.pk}"}
    await comm.disconnect()


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"subscribe": "node", "id": 999_999}, "no such node"),
        ({"subscribe": "job", "id": "1"}, "unknown group"),
        ({"subscribe": "job", "id": True}, "unknown group"),
        ({"subscribe": "job", "id": -3}, "unknown group"),
        ({"subscribe": "job"}, "unknown group"),
        ({"subscribe": "cluster", "id": 1}, "unknown group"),
        ({"subscribe": "agent", "id": 1}, "unknown group"),
        ({"subscribe": "node", "id": 1, "extra": 1}, "expected"),
        ({"resync": "job"}, "expected"),
        ({"resync": "cluster"}, 'subscribe to "cluster" first'),
        ([1, 2], "expected"),
        ({}, "expected"),
    ],
    ids=[
        "unknown-node",
        "id-not-int",
        "id-bool",
        "id-negative",
        "id-missing",
        "id-where-none-is-taken",
        "agent-group",
        "extra-key",
        "resync-other",
        "resync-unsubscribed",
        "not-an-object",
        "empty",
    ],
)
async def test_it_answers_a_bad_message_with_an_error_and_stays_usable(
    cookies: dict[str, Any], message: Any, error: str
) -> None:
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)

    await comm.send_json_to(message)
    reply = await comm.receive_json_from(timeout=TIMEOUT)
    await comm.send_json_to({"subscribe": "queue"})
    after = await comm.receive_json_from(timeout=TIMEOUT)

    assert error in reply["error"]
    assert after == {"subscribed": "queue"}
    await comm.disconnect()


@pytest.mark.parametrize(
    "raw",
    ["{not json", "x" * 5000, '"a string"'],
    ids=["malformed", "too-long", "json-not-object"],
)
async def test_it_answers_text_that_is_not_a_message_with_an_error(
    cookies: dict[str, Any], raw: str
) -> None:
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)

    await comm.send_to(text_data=raw)
    reply = await comm.receive_json_from(timeout=TIMEOUT)
    await comm.send_to(bytes_data=b"\x00\x01")
    binary = await comm.receive_json_from(timeout=TIMEOUT)

    assert "error" in reply
    assert binary == {"error": "expected a JSON text message"}
    await comm.disconnect()


async def test_every_signed_in_user_may_watch_the_cluster_the_queue_and_a_node(
    cookies: dict[str, Any], cluster: list[Any]
) -> None:
    comm = await dashboard(cookies["charlie"], GOOD_ORIGIN)

    replies = []
    for message in (
        {"subscribe": "cluster"},
        {"subscribe": "queue"},
        {"subscribe": "node", "id": cluster[0].pk},
    ):
        await comm.send_json_to(message)
        replies.append(await comm.receive_json_from(timeout=TIMEOUT))

    assert replies == [
        {"subscribed": "cluster"},
        {"subscribed": "queue"},
        {"subscribed": f"node.{cluster[0].pk}"},
    ]
    await comm.disconnect()


async def test_it_stops_sending_a_group_after_unsubscribe(
    cookies: dict[str, Any], alice_job: Job
) -> None:
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)
    await subscribe(comm, alice_job.pk)

    await comm.send_json_to({"unsubscribe": "job", "id": alice_job.pk})
    reply = await comm.receive_json_from(timeout=TIMEOUT)
    await broadcast(alice_job.pk, "running", "not for you any more")

    assert reply == {"unsubscribed": f"job.{alice_job.pk}"}
    assert await comm.receive_nothing(timeout=1)
    await comm.disconnect()


async def test_it_caps_the_subscriptions_of_one_tab(
    cookies: dict[str, Any], alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consumers, "BURST", 1000.0)  # only the cap in play
    jobs = [
        await database_sync_to_async(JobFactory)(owner=alice)
        for _ in range(consumers.MAX_GROUPS + 1)
    ]
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)
    replies = []

    for job in jobs:
        await comm.send_json_to({"subscribe": "job", "id": job.pk})
        replies.append(await comm.receive_json_from(timeout=TIMEOUT))

    assert all("subscribed" in r for r in replies[:-1])
    assert "too many subscriptions" in replies[-1]["error"]
    await comm.disconnect()


async def test_it_refuses_a_flood_then_closes_the_connection(
    cookies: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bucket refills with time: a frozen clock makes the count exact.
    monkeypatch.setattr(live, "monotonic", lambda: 1000.0)
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)
    burst = int(consumers.BURST)

    replies = []
    for _ in range(burst + 2):
        await comm.send_json_to({"subscribe": "queue"})
        replies.append(await comm.receive_json_from(timeout=TIMEOUT))
    for _ in range(consumers.MAX_REFUSED - 2):  # refused and answered
        await comm.send_json_to({"subscribe": "queue"})
        await comm.receive_json_from(timeout=TIMEOUT)
    await comm.send_json_to({"subscribe": "queue"})
    closed = await comm.receive_output(timeout=TIMEOUT)

    assert replies[:burst] == [{"subscribed": "queue"}] * burst
    assert replies[burst:] == [{"error": "too many messages: at most 5 a second"}] * 2
    assert closed == {"type": "websocket.close", "code": consumers.CLOSE_TOO_MANY}
    await comm.disconnect()


# ------------------------------------------------------------------ live updates


async def agent(token: str) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(
        application,
        "/ws/agent/",
        headers=[(b"authorization", f"Bearer {token}".encode())],
    )
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    return comm


async def send_metrics(
    comm: WebsocketCommunicator, node: Node, seq: int, util: float, attempt: int
) -> None:
    gpus = await database_sync_to_async(lambda: list(node.gpus.order_by("index")))()
    data = protocol.MetricsData(
        sampled_at=time.time(),
        gpus=[
            protocol.GpuSample(
                index=g.index,
                uuid=g.uuid,
                util_gpu=util,
                memory_used_mib=2048,
                memory_total_mib=g.memory_total_mib,
                processes=[
                    protocol.ProcessSample(
                        pid=7, used_memory_mib=2000, attempt_id=attempt
                    )
                ]
                if g.index == 0
                else [protocol.ProcessSample(pid=66, used_memory_mib=512)],
            )
            for g in gpus
        ],
    )
    await comm.send_to(text_data=agent_frame(protocol.Metrics, data, seq))
    ack = await comm.receive_json_from(timeout=TIMEOUT)
    assert ack["type"] == "ack"


async def test_a_tab_gets_its_nodes_and_jobs_updates_from_the_agent(
    cookies: dict[str, Any], alice: User
) -> None:
    """An agent's metrics frame reaches a tab watching its node and one watching
    the job on it; the job's output too; charlie, refused the job, gets none."""
    node, token = await database_sync_to_async(make_node)("node-a", 2)
    job = await database_sync_to_async(JobFactory)(owner=alice, name="<b>j</b>")
    attempt = await database_sync_to_async(start_job)(job, node)
    node_tab = await dashboard(cookies["charlie"], GOOD_ORIGIN)
    job_tab = await dashboard(cookies["alice"], GOOD_ORIGIN)
    node_reply = await subscribe_to(node_tab, {"subscribe": "node", "id": node.pk})
    job_reply = await subscribe(job_tab, job.pk)
    refused = await subscribe(node_tab, job.pk)
    agent_comm = await agent(token)

    await send_metrics(agent_comm, node, 1, 77.0, attempt.pk)
    node_update = await node_tab.receive_json_from(timeout=TIMEOUT)
    job_update = await job_tab.receive_json_from(timeout=TIMEOUT)
    log = protocol.JobLogData(
        attempt_id=attempt.pk, job_id=job.pk, offset=0, data="<script>x</script>\n"
    )
    await agent_comm.send_to(text_data=agent_frame(protocol.JobLog, log, 2))
    await agent_comm.receive_json_from(timeout=TIMEOUT)  # the ack
    chunk = await job_tab.receive_json_from(timeout=TIMEOUT)

    assert node_reply == {"subscribed": f"node.{node.pk}"}
    assert job_reply == {"subscribed": f"job.{job.pk}"}
    assert refused == {"error": "no such job"}
    assert node_update["type"] == "node.metrics"
    assert [g["util"] for g in node_update["gpus"]] == [77.0, 77.0]
    assert node_update["gpus"][0]["procs"][0]["job"] == job.pk
    assert node_update["gpus"][1]["procs"] == [
        {"pid": 66, "mib": 512, "sm": None, "attempt": None, "job": None}
    ]
    assert job_update["type"] == "job.metrics"
    assert [(g["index"], g["own_mib"]) for g in job_update["gpus"]] == [(0, 2000)]
    assert chunk == {
        "type": "job.log",
        "job": job.pk,
        "attempt": attempt.pk,
        "node": node.pk,
        "offset": 0,
        "data": "<script>x</script>\n",
    }
    # charlie's tab may get its node's state (a foreign process appeared), never
    # anything of alice's job
    assert not [
        m for m in await drain(node_tab) if m.get("type", "").startswith("job.")
    ]
    for comm in (agent_comm, node_tab, job_tab):
        await comm.disconnect()


async def drain(comm: WebsocketCommunicator, quiet: float = 1.5) -> list[Any]:
    """Every message until none comes for ``quiet`` seconds."""
    out = []
    while not await comm.receive_nothing(timeout=quiet):
        out.append(await comm.receive_json_from(timeout=TIMEOUT))
    return out


async def subscribe_to(
    comm: WebsocketCommunicator, message: dict[str, Any]
) -> dict[str, Any]:
    await comm.send_json_to(message)
    return await comm.receive_json_from(timeout=TIMEOUT)


async def test_a_new_cluster_tab_gets_the_whole_state_and_can_ask_again(
    cookies: dict[str, Any], cluster: list[Any]
) -> None:
    hub = live.Hub.current()
    assert await hub.publish_once() == 1  # the state other tabs already have
    comm = await dashboard(cookies["bob"], GOOD_ORIGIN)

    reply = await subscribe_to(comm, {"subscribe": "cluster"})
    whole = await comm.receive_json_from(timeout=TIMEOUT)
    again = await subscribe_to(comm, {"resync": "cluster"})

    assert reply == {"subscribed": "cluster"}
    assert whole["type"] == "cluster.state"
    assert whole["state"]["seq"] == 1
    assert [n["name"] for n in whole["state"]["nodes"]] == ["node-a", "node-b"]
    assert len(whole["state"]["gpus"]) == 6
    assert again == whole
    await comm.disconnect()


async def test_a_tab_gets_its_groups_back_when_redis_lost_them(
    cookies: dict[str, Any], cluster: list[Any]
) -> None:
    """A Redis restart loses the tab's group memberships (and the watch set)
    while its websocket stays open: the hub's ticker notices and the tab joins
    again, saying ``subscribed`` again so that the page re-syncs."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    assert layer is not None
    node_group = events.node_group(cluster[0].pk)
    comm = await dashboard(cookies["charlie"], GOOD_ORIGIN)
    await comm.send_json_to({"subscribe": "node", "id": cluster[0].pk})
    assert await comm.receive_json_from(timeout=TIMEOUT) == {"subscribed": node_group}
    hub = live.Hub.current()
    (tab,) = hub.members
    await hub.lost_data()  # the epoch as it is now (the ticker's, or ours)

    # What a restart does to the tab's part of Redis.
    await layer.group_discard(node_group, tab.channel_name)  # type: ignore[attr-defined]
    await hub.redis.delete(hub.watch_key, hub.epoch_key)
    again = await comm.receive_json_from(timeout=TIMEOUT)
    hub.forget_watched()
    watched = await hub.watched()
    await layer.group_send(
        node_group,
        {"type": "node.metrics", "node": cluster[0].pk, "at": time.time(), "gpus": []},
    )
    update = await comm.receive_json_from(timeout=TIMEOUT)

    assert again == {"subscribed": node_group}
    assert node_group in watched
    assert update["type"] == "node.metrics"
    await comm.disconnect()
    assert not hub.members
