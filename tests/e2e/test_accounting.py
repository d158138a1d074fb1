"""Two jobs sharing one GPU on real processes (web server, worker, a simulated
agent): when both have ended, each is charged its share of the GPU by declared
memory, from the agent-reported times, and together exactly the GPU's time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import Stack, csrf_post, login, wait_for_job
from tests.e2e.test_colocation import submit_shareable

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_two_jobs_sharing_a_gpu_are_each_charged_their_share(
    stack: Stack, alice: User, bob: User
) -> None:
    from scheduler.models import Attempt, UsageRecord

    _node, _agent = stack.start_node("e2e-charge", "1xA100-80GB", 1)
    mine = login(stack.base_url, "alice", "pw-alice")
    theirs = login(stack.base_url, "bob", "pw-bob")

    # alice declares 16 GiB and runs until cancelled; bob joins with 48 GiB
    first = submit_shareable(mine, "rn18", "ResNet-18 (batch size 32)", memory="16G")
    assert wait_for_job(first, {"running"}) == "running"
    second = submit_shareable(
        theirs, "lm", "LM (batch size 20)", command="sleep 3", memory="48G"
    )
    assert wait_for_job(second, {"running", "completed"}) in {"running", "completed"}
    assert wait_for_job(second, {"completed"}) == "completed"
    assert csrf_post(mine, f"/jobs/{first}/cancel/", {}).status_code == 302
    assert wait_for_job(first, {"cancelled"}) == "cancelled"

    a = Attempt.objects.get(job_id=first)
    b = Attempt.objects.get(job_id=second)
    assert a.started_at and a.ended_at and b.started_at and b.ended_at
    assert a.started_at < b.started_at < b.ended_at < a.ended_at  # b inside a
    overlap = (b.ended_at - b.started_at).total_seconds()
    whole = (a.ended_at - a.started_at).total_seconds()
    charged_a = UsageRecord.objects.get(attempt=a).gpu_seconds
    charged_b = UsageRecord.objects.get(attempt=b).gpu_seconds
    assert charged_b == pytest.approx(overlap * 48 / 64)
    assert charged_a == pytest.approx(whole - overlap + overlap * 16 / 64)
    assert charged_a + charged_b == pytest.approx(whole)  # once, not twice
    assert UsageRecord.objects.get(attempt=b).share == pytest.approx(0.75)


def test_a_job_that_ends_while_its_node_is_lost_is_charged_to_its_real_exit(
    stack: Stack, alice: User
) -> None:
    """The agent dies, the portal declares the node lost (beat's check, called
    here as beat calls it) and fails the job at the last heartbeat; the job ends
    later with no agent watching; the restarted agent replays the exit, and the
    charge runs to it. The job is failed once, and stays failed."""
    import signal
    from datetime import timedelta

    from django.conf import settings
    from django.db.models import F

    from scheduler import services
    from scheduler.models import (
        Attempt,
        Job,
        JobEvent,
        Node,
        PortalHearing,
        UsageRecord,
    )
    from tests.e2e.conftest import submit, wait_until
    from tests.e2e.test_job_lifecycle import statuses

    node, agent = stack.start_node("e2e-lost", "1xA100-80GB", 1)
    token = (stack.tmp / "agent-e2e-lost" / "token").read_text()
    client = login(stack.base_url, "alice", "pw-alice")
    marker = stack.tmp / "finish"
    job_id = submit(
        client,
        "outlives-its-agent",
        f"while [ ! -e {marker} ]; do sleep 0.1; done; exit 0",
        on_node_loss="fail",
    )
    assert wait_for_job(job_id, {"running"}) == "running"
    attempt = Attempt.objects.get(job_id=job_id)

    agent.popen.send_signal(signal.SIGKILL)
    agent.popen.wait(10)
    stack.procs["web"].wait_for(r"agent of node e2e-lost disconnected")
    # Beat's check, once the node has been silent for GPULAB_NODE_LOST_AFTER
    # while the portal heard (its web process pulsing all along): both moved
    # back in time, as if that long had passed.
    silent = Node.objects.get(pk=node.pk).last_seen_at
    assert silent is not None
    back = timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER + 1)
    Node.objects.filter(pk=node.pk).update(last_seen_at=silent - back)
    assert PortalHearing.objects.filter(pk=1).update(
        hearing_since=F("hearing_since") - 2 * back
    )
    assert services.mark_lost_nodes() == [node.pk]
    assert wait_for_job(job_id, {"failed"}) == "failed"
    attempt.refresh_from_db()
    estimated = attempt.ended_at
    assert estimated is not None and attempt.outcome == "node_lost"

    marker.touch()  # the job ends with no agent watching
    exit_file = stack.tmp / "agent-e2e-lost" / "jobs" / str(attempt.pk) / "exit_code"
    wait_until(exit_file.exists, what="the shim's exit_code file")
    stack.start_agent("e2e-lost", token, "1xA100-80GB").wait_for(r"connected to ws://")

    note = wait_until(
        lambda: JobEvent.objects.filter(
            job_id=job_id, message__contains="charged again"
        ).first(),
        what="the replayed exit's correction",
    )
    attempt.refresh_from_db()
    assert attempt.ended_at is not None and attempt.ended_at > estimated
    assert attempt.exit_code == 0
    charged = UsageRecord.objects.get(attempt=attempt).gpu_seconds
    assert charged == pytest.approx(
        (attempt.ended_at - attempt.started_at).total_seconds()  # type: ignore[operator]
    )
    assert "reported after the portal had ended it" in note.message
    assert Job.objects.get(pk=job_id).status == "failed"
    assert statuses(job_id) == ["pending", "starting", "running", "failed"]
