"""A kill is never lost, on real processes (uvicorn, a Celery worker and beat, a
simulated agent that really runs the job's command): a ``job.kill`` whose first
send never reached the agent is sent again, by beat's ``resend_kills`` while the
agent stays connected, or by the node's hello when it reconnects, and the job
ends as asked instead of keeping its GPU."""

from __future__ import annotations

import sys
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

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beat's checks every second; a kill with no exit re-sent 1 s after the
    job's grace."""
    set_fast_liveness(monkeypatch, GPULAB_KILL_RESEND_AFTER="1")


# A process that dies after its transaction commits and before its after-commit
# callbacks run (the sends): its first callback, registered before the verb's,
# ends it on the spot, as a crash or an OOM kill at that instant would.
DIE_AFTER_COMMIT = """
import os, sys
import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django.setup()
from django.contrib.auth.models import User
from django.db import transaction

from scheduler import services

with transaction.atomic():
    transaction.on_commit(lambda: os._exit(3))
    services.requeue_job(int(sys.argv[1]), by=User.objects.get(username=sys.argv[2]))
print("sends were made")
"""


def statuses(job_id: int) -> list[str]:
    from scheduler.models import JobEvent

    return [
        s
        for s in JobEvent.objects.filter(job_id=job_id)
        .order_by("at", "id")
        .values_list("to_status", flat=True)
        if s
    ]


def test_a_requeue_whose_kill_died_with_its_process_is_resent_by_beat(
    stack: Stack,
    alice: User,
    admin_user: User,
    marker: Path,
) -> None:
    import subprocess

    from django.contrib.auth.models import Permission

    from scheduler.models import Attempt, Job, JobEvent

    start_beat(stack)
    _, agent = stack.start_node("node-a", "1xA100-80GB", 1)
    admin_user.user_permissions.add(Permission.objects.get(codename="requeue_job"))
    client = login(stack.base_url, "alice", "pw-alice")
    runs = stack.tmp / "runs"
    job = submit(client, "requeue-me", waiting_command(marker, runs), kill_grace="1")
    assert wait_for_job(job, {"running"}) == "running"
    first = Attempt.objects.get(job_id=job)
    group = job_pgid(stack, "node-a", first.pk)

    # The admin's requeue commits; its process dies before sending the kill.
    crashed = subprocess.run(
        [sys.executable, "-c", DIE_AFTER_COMMIT, str(job), admin_user.username],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert crashed.returncode == 3, crashed.stdout + crashed.stderr
    first.refresh_from_db()
    assert first.kill_reason == "requeued"
    assert first.kill_resends == 0

    # Beat sees no exit once the job's grace and the delay are past: it sends the
    # kill again, the agent stops the run, and the job is requeued as asked.
    agent.wait_for(rf"attempt {first.pk}: kill \(requeued", timeout=60)
    wait_until(
        lambda: Attempt.objects.get(pk=first.pk).ended_at is not None,
        what="the first attempt's exit",
    )
    first.refresh_from_db()
    assert first.kill_resends >= 1
    assert not alive(group)
    [event] = JobEvent.objects.filter(job_id=job, message__contains="kill re-sent")
    assert "requeued" in event.message

    # It runs again (a second attempt) and completes.
    assert wait_for_job(job, {"running"}) == "running"
    marker.touch()
    assert wait_for_job(job, set(Job.TERMINAL)) == "completed"
    assert statuses(job) == [
        "pending", "starting", "running",  # first attempt, requeued
        "pending", "starting", "running",  # second attempt
        "completed",
    ]  # fmt: skip
    second = Attempt.objects.get(job_id=job, number=2)
    assert runs.read_text().split() == [str(first.pk), str(second.pk)]


def test_a_cancel_sent_while_the_agent_was_away_is_resent_at_its_hello(
    stack: Stack, alice: User, marker: Path
) -> None:
    from scheduler import services
    from scheduler.models import Attempt, Job

    # No beat: only the node's hello can deliver the kill again (beat's re-send
    # would wait the job's grace and GPULAB_KILL_RESEND_AFTER, 60 s, anyway).
    _, agent = stack.start_node("node-a", "1xA100-80GB", 1)
    client = login(stack.base_url, "alice", "pw-alice")
    job = submit(client, "cancel-me", waiting_command(marker, stack.tmp / "runs"))
    assert wait_for_job(job, {"running"}) == "running"
    attempt = Attempt.objects.get(job_id=job)
    group = job_pgid(stack, "node-a", attempt.pk)

    # The web process dies: the agent is disconnected when the cancel is sent
    # (to the dead connection's channel: no consumer ever reads it).
    web = stack.procs["web"]
    seen = len(agent.lines)  # the agent's one line for the lost link may come first
    web.popen.kill()
    web.popen.wait(10)
    agent.wait_for(r"link to .* down|server closed the connection", start=seen)
    services.cancel_job(job, by=alice)
    assert Job.objects.get(pk=job).status == "running"  # until its exit comes

    # The web is back; the agent reconnects and its hello lists the run.
    seen = len(agent.lines)
    stack.start_web("web-2").wait_for(r"Uvicorn running on")
    agent.wait_for(r"connected to ws://", start=seen)
    agent.wait_for(rf"attempt {attempt.pk}: kill \(cancelled", start=seen)
    assert wait_for_job(job, set(Job.TERMINAL), timeout=30) == "cancelled"
    assert not alive(group)
    assert statuses(job) == ["pending", "starting", "running", "cancelled"]
