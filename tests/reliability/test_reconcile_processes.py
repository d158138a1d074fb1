"""The reconciler on real processes: a node rebooted under a running job (its
processes and the agent's state directory gone) comes back within the lost-node
timeout, so nothing else notices; the database still has the job running there.
Beat's reconciler sees the agent's reports lack it, ends it as lost once, and the
job runs again: no ghost allocation holding the GPU until the time limit."""

from __future__ import annotations

import os
import shutil
import signal
from typing import TYPE_CHECKING

import pytest

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


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    # The node is never declared lost here: the reconciler alone must act.
    set_fast_liveness(monkeypatch, GPULAB_NODE_LOST_AFTER="120")


def test_a_job_that_vanished_from_its_node_is_ended_and_run_again(
    stack: Stack, alice: User, marker: Path
) -> None:
    from scheduler.models import Allocation, Attempt, Job, JobEvent, Node

    start_beat(stack)
    node, agent = stack.start_node("reboot", "1xA100-80GB", 1)
    token = (stack.tmp / "agent-reboot" / "token").read_text()
    client = login(stack.base_url, "alice", "pw-alice")
    runs = stack.tmp / "runs"
    job_id = submit(client, "survives-reboot", waiting_command(marker, runs))
    assert wait_for_job(job_id, {"running"}) == "running"
    first = Attempt.objects.get(job_id=job_id)
    state = stack.tmp / "agent-reboot"
    group = job_pgid(stack, "reboot", first.pk)
    shim = int((state / "jobs" / str(first.pk) / "shim.pid").read_text().split()[0])

    # The node reboots: agent, shim and job die, the state directory is lost.
    agent.popen.send_signal(signal.SIGKILL)
    agent.popen.wait(10)
    os.killpg(group, signal.SIGKILL)
    os.kill(shim, signal.SIGKILL)
    wait_until(lambda: not alive(group), what="the job's processes gone")
    shutil.rmtree(state)
    agent = stack.start_agent("reboot", token, "1xA100-80GB")
    agent.wait_for(r"connected to ws://")

    second = wait_until(
        lambda: Attempt.objects.filter(
            job_id=job_id, number=2, started_at__isnull=False
        ).first(),
        timeout=60,
        what="the job running again",
    )

    first.refresh_from_db()
    assert first.outcome == Attempt.Outcome.LOST
    assert Node.objects.get(pk=node.pk).status == Node.Status.UP  # never lost
    repairs = JobEvent.objects.filter(job_id=job_id, message__startswith="reconciler:")
    assert [e.message.split(";")[0] for e in repairs] == [
        f"reconciler: the agent of reboot has not listed attempt 1 since"
        f" {first.ended_at:%Y-%m-%d %H:%M:%S} UTC (it does not run it)"
    ]
    live = Allocation.objects.filter(released_at__isnull=True)  # every slot
    assert set(live.values_list("attempt_id", flat=True)) == {second.pk}
    marker.touch()
    assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"
    assert runs.read_text().split() == [str(first.pk), str(second.pk)]
