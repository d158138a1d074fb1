"""A node lost and back, on real processes (uvicorn, a Celery worker and beat,
two simulated agents that really run the jobs' commands): its jobs are requeued
or failed exactly once, charged for the time they actually ran (estimated at the
node's last heartbeat, corrected when the node replays the real exits); when it
returns, the runs the portal had ended are killed by attempt id, so once it is
back no job runs twice and no allocation is left behind."""

from __future__ import annotations

import signal
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone

from tests.e2e.conftest import login, submit, wait_for_job, wait_until
from tests.reliability.processes import (
    alive,
    job_pgid,
    set_fast_liveness,
    start_beat,
    waiting_command,
)

if TYPE_CHECKING:
    from pathlib import Path

    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LOST_AFTER = 5


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    set_fast_liveness(monkeypatch, GPULAB_NODE_LOST_AFTER=str(LOST_AFTER))


def statuses(job_id: int) -> list[str]:
    from scheduler.models import JobEvent

    return [
        s
        for s in JobEvent.objects.filter(job_id=job_id)
        .order_by("at", "id")
        .values_list("to_status", flat=True)
        if s
    ]


def test_a_lost_node_requeues_once_and_its_stale_runs_die_when_it_returns(
    stack: Stack, alice: User, marker: Path
) -> None:
    from scheduler.models import Allocation, Attempt, Job, JobEvent, Node, UsageRecord

    start_beat(stack)
    node_a, agent_a = stack.start_node("node-a", "2xA100-80GB", 2)
    client = login(stack.base_url, "alice", "pw-alice")
    runs = {"requeue": stack.tmp / "runs-requeue", "fail": stack.tmp / "runs-fail"}
    requeue = submit(client, "requeue-me", waiting_command(marker, runs["requeue"]))
    fail = submit(
        client, "fail-me", waiting_command(marker, runs["fail"]), on_node_loss="fail"
    )
    assert wait_for_job(requeue, {"running"}) == "running"
    assert wait_for_job(fail, {"running"}) == "running"
    first = Attempt.objects.get(job_id=requeue)
    failing = Attempt.objects.get(job_id=fail)
    groups = {
        "first": job_pgid(stack, "node-a", first.pk),
        "failing": job_pgid(stack, "node-a", failing.pk),
    }
    node_b, _ = stack.start_node("node-b", "1xA100-80GB", 1)

    # Node A's agent freezes: no heartbeat, but its jobs run on (own sessions).
    agent_a.popen.send_signal(signal.SIGSTOP)
    try:
        wait_until(
            lambda: Node.objects.get(pk=node_a.pk).status == Node.Status.LOST,
            timeout=60,
            what="node-a declared lost",
        )
        assert wait_for_job(fail, {"failed"}) == "failed"
        second = wait_until(
            lambda: Attempt.objects.filter(
                job_id=requeue, number=2, started_at__isnull=False
            ).first(),
            timeout=60,
            what="the requeued job running on node-b",
        )
        # Cut off, node-a could not be told: until it is back both runs exist.
        assert second.node_id == node_b.pk
        assert alive(groups["first"]) and alive(groups["failing"])
        # Meanwhile its run is charged until node-a was last heard from.
        first.refresh_from_db()
        assert first.outcome == Attempt.Outcome.NODE_LOST
        estimate = first.ended_at
        lost_at = JobEvent.objects.get(
            job_id=requeue, message__startswith="node node-a lost"
        ).at
        assert estimate is not None
        assert estimate <= lost_at - timedelta(seconds=LOST_AFTER)
    finally:
        agent_a.popen.send_signal(signal.SIGCONT)

    # Back: its next heartbeat is refused (4410), it says hello, and the portal
    # has it kill the two attempts it ended, by id.
    wait_until(
        lambda: not alive(groups["first"]) and not alive(groups["failing"]),
        timeout=60,
        what="node-a's stale runs killed",
    )
    agent_a.wait_for(rf"attempt {first.pk}: kill \(stale")
    agent_a.wait_for(rf"attempt {failing.pk}: kill \(stale")
    wait_until(lambda: Node.objects.get(pk=node_a.pk).status == Node.Status.UP)
    second_group = job_pgid(stack, "node-b", second.pk)
    assert alive(second_group)  # the one run of the job now
    assert not Allocation.objects.filter(
        gpu__node=node_a, released_at__isnull=True
    ).exists()

    # Requeued and failed exactly once; the killed runs' late exits change nothing.
    lost_events = JobEvent.objects.filter(message__startswith="node node-a lost")
    assert sorted(lost_events.values_list("job_id", "to_status")) == [
        (requeue, "pending"),
        (fail, "failed"),
    ]
    # The killed run's exit, replayed by node-a, puts its real end in place of
    # the estimate (it did run while cut off) and charges again: charged for the
    # time it actually ran, no more.
    wait_until(
        lambda: str(node_a.pk) in Attempt.objects.get(pk=first.pk).rank_exits,
        what="the killed run's exit",
    )
    first.refresh_from_db()
    assert first.started_at is not None and first.ended_at is not None
    assert estimate < lost_at < first.ended_at <= timezone.now()
    [usage] = UsageRecord.objects.filter(attempt=first)
    # (The database keeps microseconds; the charge is from the agent's float times.)
    assert usage.gpu_seconds == pytest.approx(
        (first.ended_at - first.started_at).total_seconds(), abs=1e-3
    )
    corrections = JobEvent.objects.filter(
        job_id=requeue, message__contains="reported after the portal had ended it"
    )
    assert corrections.count() == 1

    marker.touch()
    assert wait_for_job(requeue, set(Job.TERMINAL)) == "completed"
    assert statuses(requeue) == [
        "pending", "starting", "running",  # on node-a
        "pending", "starting", "running",  # requeued, on node-b
        "completed",
    ]  # fmt: skip
    assert statuses(fail) == ["pending", "starting", "running", "failed"]
    # Each attempt ran once (one line each), never a relaunch on node-a.
    assert runs["requeue"].read_text().split() == [str(first.pk), str(second.pk)]
    assert runs["fail"].read_text().split() == [str(failing.pk)]
    assert Job.objects.get(pk=fail).status == "failed"
