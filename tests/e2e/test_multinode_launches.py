"""Jobs spanning nodes on real processes (uvicorn, a Celery worker, two simulated
2-GPU agents): a lost launch of one rank is re-sent, and a busy rendezvous port on
rank 0's node makes the portal relaunch the job with another port."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest

from tests.e2e.conftest import Stack, csrf_post, login, wait_for_job, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

COMMAND = 'echo "rank=$PET_NODE_RANK port=$MASTER_PORT"'


@pytest.fixture
def two_nodes(stack: Stack) -> Stack:
    from scheduler import services
    from scheduler.models import Node

    for name in ("span-a", "span-b"):
        _, token = services.create_node(name)
        stack.start_agent(name, token, "2xA100-80GB")
        stack.procs["web"].wait_for(rf"agent of node {name} connected")
    wait_until(
        lambda: (
            Node.objects.filter(status="up", gpus__isnull=False).distinct().count() == 2
        ),
        what="both nodes' hello",
    )
    return stack


def next_attempt_id() -> int:
    """The id PostgreSQL gives the next attempt (nothing else creates one here)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_serial_sequence('scheduler_attempt', 'id')",
        )
        (sequence,) = cursor.fetchone()
        cursor.execute(f"SELECT last_value, is_called FROM {sequence}")
        last, called = cursor.fetchone()
    return int(last) + 1 if called else int(last)


@pytest.fixture
def listener() -> Iterator[Any]:
    """Make a port busy: a socket really listening on it, on every address."""
    sockets: list[socket.socket] = []

    def listen(port: int) -> None:
        sock = socket.socket()
        sock.bind(("0.0.0.0", port))
        sock.listen()
        sockets.append(sock)

    yield listen
    for sock in sockets:
        sock.close()


def test_a_busy_rendezvous_port_relaunches_the_job_with_another_port(
    two_nodes: Stack, alice: User, listener: Any
) -> None:
    from scheduler import services
    from scheduler.models import Attempt, Job, JobEvent

    first_id = next_attempt_id()
    busy_port = 29500 + first_id % 1000  # what the portal will give attempt first_id
    listener(busy_port)
    client = login(two_nodes.base_url, "alice", "pw-alice")
    resp = csrf_post(
        client,
        "/jobs/new/",
        {
            "name": "ddp",
            "command": COMMAND,
            "workdir": "/tmp",
            "gpus": "4",
            "priority_class": "normal",
        },
    )
    assert resp.status_code == 302, resp.text
    job_id = int(resp.headers["location"].strip("/").split("/")[-1])

    assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"

    first, second = Attempt.objects.filter(job_id=job_id).order_by("number")
    assert first.pk == first_id
    assert first.outcome == Attempt.Outcome.PORT_BUSY
    assert second.outcome == Attempt.Outcome.EXITED
    # Rank 0 refused before starting anything; rank 1 may have started (then
    # stopped), so only the second attempt's starts are known for sure.
    assert str(first.node_id) not in first.rank_starts
    assert set(second.rank_starts) == {str(n) for n in second.node_ids}
    events = list(
        JobEvent.objects.filter(job_id=job_id).values_list("message", flat=True)
    )
    assert any(
        m.startswith(f"rendezvous port {busy_port} busy") and "relaunching" in m
        for m in events
    ), events
    job = Job.objects.get(pk=job_id)
    wait_until(
        lambda: services.log_tail(job).count(f"port={29500 + second.pk % 1000}") == 2,
        what="both ranks' output of the second attempt",
    )
    # Rank 0 never ran with the busy port. Rank 1 of the first attempt may have:
    # its echo needs no rendezvous and can beat its peer_failed kill.
    assert f"rank=0 port={busy_port}" not in services.log_tail(job)


def test_a_lost_launch_of_one_rank_is_sent_again(
    two_nodes: Stack, alice: User, settings: Any
) -> None:
    from django.db import connection
    from django.utils import timezone

    from scheduler import events, pass_runner, services
    from scheduler.models import Attempt, Job, JobEvent
    from tests.factories import JobFactory

    real_send = events.send_to_agent
    dropped: list[int] = []

    def lossy(node_id: int, frame: dict[str, Any]) -> None:
        """The channel layer loses rank 1's launch (its node stays connected)."""
        if (
            frame["type"] == "job.launch"
            and frame["data"]["env"].get("PET_NODE_RANK") == "1"
        ):
            dropped.append(node_id)
            return
        real_send(node_id, frame)

    # The pass that starts the job runs here, with the lossy channel layer: we hold
    # the scheduling lock (re-entrant for this connection), so the worker's passes
    # stand aside until then.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [pass_runner.SCHEDULE_LOCK_KEY])
    try:
        job = JobFactory(owner=alice, gpus=4, command=COMMAND, workdir="/tmp")
        with mock.patch("scheduler.events.send_to_agent", lossy):
            result = pass_runner.schedule_pass_body()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_unlock(%s)", [pass_runner.SCHEDULE_LOCK_KEY]
            )
    assert sum(p["started"] for p in result["passes"]) == 1
    assert len(dropped) == 1
    # Rank 0 runs (and may end); the job cannot end without rank 1.
    assert wait_for_job(job.pk, {"running"}) == "running"
    attempt = Attempt.objects.get(job=job)
    rank0 = attempt.node_ids[0]
    wait_until(
        lambda: str(rank0) in Attempt.objects.get(pk=attempt.pk).rank_exits,
        what="rank 0's exit",
    )
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING

    # The node check, once the delay has passed: rank 1's launch goes again.
    later = timezone.now() + timedelta(seconds=settings.GPULAB_LAUNCH_RESEND_AFTER)
    assert services.resend_launches(later) == [attempt.pk]

    assert wait_for_job(job.pk, set(Job.TERMINAL)) == "completed"
    attempt.refresh_from_db()
    assert attempt.launch_resends == 1
    assert set(attempt.rank_starts) == {str(n) for n in attempt.node_ids}
    # The timeline says so too.
    messages = list(JobEvent.objects.filter(job=job).values_list("message", flat=True))
    assert any("rank 1: launch re-sent to" in m for m in messages), messages
    assert any("rank 1: running on" in m for m in messages), messages
    wait_until(
        lambda: (
            "rank=0" in services.log_tail(job) and "rank=1" in services.log_tail(job)
        ),
        what="both ranks' output",
    )
