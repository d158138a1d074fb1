"""A portal outage longer than ``GPULAB_NODE_LOST_AFTER``, on real processes
(uvicorn, a Celery worker and beat, a simulated agent that really runs the job's
command): the web tier, the worker and beat all stop while the node keeps its job
running. A node is judged lost only on time the portal could hear it (the web
tier's hearing pulse, ``services.presence.hearing_since``), so when they come back
(the judge first, while no web process serves yet) the node is not lost, the job
is not requeued, and it completes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import login, submit, wait_for_job, wait_until
from tests.reliability.processes import (
    alive,
    job_pgid,
    set_fast_liveness,
    start_beat,
    start_worker,
    waiting_command,
)

if TYPE_CHECKING:
    from pathlib import Path

    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LOST_AFTER = 5


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    set_fast_liveness(monkeypatch, GPULAB_NODE_LOST_AFTER=str(LOST_AFTER))


def test_a_portal_outage_longer_than_the_timeout_requeues_nothing(
    stack: Stack, alice: User, marker: Path
) -> None:
    from scheduler.models import Attempt, Job, JobEvent, Node

    start_beat(stack)
    node, agent = stack.start_node("node-a", "1xA100-80GB", 1)
    client = login(stack.base_url, "alice", "pw-alice")
    runs = stack.tmp / "runs"
    job = submit(client, "outlive-the-portal", waiting_command(marker, runs))
    assert wait_for_job(job, {"running"}) == "running"
    attempt = Attempt.objects.get(job_id=job)
    group = job_pgid(stack, "node-a", attempt.pk)

    # The whole portal stops; the agent keeps its job running and keeps trying
    # (its one line for the lost link may come before stop() returns).
    seen = len(agent.lines)
    for name in ("beat", "worker", "web"):
        stack.procs[name].stop()
    agent.wait_for(r"link to .* down|server closed the connection", start=seen)
    # The outage itself: twice the timeout (a duration, no event to wait for).
    time.sleep(2 * LOST_AFTER)
    assert alive(group)

    # The judge comes back first: beat's checks run while no web process serves
    # (the portal cannot hear the node yet), and judge nobody.
    worker = start_worker(stack, "worker-2")
    start_beat(stack, "beat-2")
    wait_until(
        lambda: (
            "not judged lost" in worker.output(400)
            or Node.objects.get(pk=node.pk).status == Node.Status.LOST
        ),
        timeout=60,
        what="beat's check of the silent node",
    )
    assert Node.objects.get(pk=node.pk).status == Node.Status.UP

    # The web tier is back: the node says hello and is heard again.
    seen = len(agent.lines)
    stack.start_web("web-2").wait_for(r"Uvicorn running on")
    agent.wait_for(r"connected to ws://", start=seen)
    wait_until(
        lambda: Node.objects.filter(pk=node.pk, connected=True).exists(),
        what="the node connected again",
    )
    assert Node.objects.get(pk=node.pk).status == Node.Status.UP
    assert alive(group)

    marker.touch()
    assert wait_for_job(job, set(Job.TERMINAL)) == "completed"
    assert [
        s
        for s in JobEvent.objects.filter(job_id=job)
        .order_by("at", "id")
        .values_list("to_status", flat=True)
        if s
    ] == ["pending", "starting", "running", "completed"]
    assert runs.read_text().split() == [str(attempt.pk)]  # it ran once
    assert not JobEvent.objects.filter(job_id=job, message__contains="lost").exists()
    attempt.refresh_from_db()
    assert attempt.outcome == Attempt.Outcome.EXITED
