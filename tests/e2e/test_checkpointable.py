"""A checkpointable job preempted on real processes: uvicorn, a Celery worker, a
simulated node agent whose shim signals the job, PostgreSQL and Redis."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import Stack, wait_for_job, wait_until

if TYPE_CHECKING:
    from pathlib import Path

    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def script(marker: Path) -> str:
    """Print the restart count; on a restart, finish. Else report a checkpoint,
    then wait; on SIGUSR1 report another, leave ``marker`` and exit 0 (its grace
    is 30 s)."""
    return (
        'echo "restart count: $GPULAB_RESTART_COUNT"; '
        '[ "$GPULAB_RESTART_COUNT" -gt 0 ] && exit 0; '
        f"trap 'echo GPULAB_CHECKPOINT on USR1; echo saved > {marker}; exit 0' USR1; "
        "echo GPULAB_CHECKPOINT step 1; "
        "while :; do sleep 0.1; done"
    )


def test_a_checkpointable_job_is_signalled_requeued_and_resumed(
    stack: Stack, alice: User, tmp_path: Path
) -> None:
    from portal.notifications.models import Delivery
    from scheduler import services
    from scheduler.models import Attempt, Job, JobEvent, JobLogChunk, UsageRecord
    from scheduler.services.jobs import JobRequest

    stack.start_node("ckpt-node", "1xA100-80GB", 1)
    marker = tmp_path / "checkpoint-saved"
    victim = services.submit_job(
        alice,
        JobRequest(
            name="trains",
            command=script(marker),
            workdir="/tmp",
            priority_class="best-effort",
            checkpointable=True,
            checkpoint_signal="USR1",
            checkpoint_grace_s=30,
        ),
    )
    assert wait_for_job(victim.pk, {"running"}) == "running"
    wait_until(
        lambda: Attempt.objects.filter(
            job=victim, checkpoint_at__isnull=False
        ).exists(),
        what="the first checkpoint line reaching the portal",
    )

    # A normal-class job needs the only GPU: the pass preempts the victim.
    needs = services.submit_job(
        alice,
        JobRequest(name="needs-gpu", command="echo needed", workdir="/tmp"),
    )

    assert wait_for_job(needs.pk, set(Job.TERMINAL)) == "completed"
    # USR1 reached the script's trap (SIGTERM would have killed it untrapped):
    # it saved within its grace and exited by itself.
    assert marker.read_text() == "saved\n"
    first = Attempt.objects.get(job=victim, number=1)
    assert first.kill_reason == "preempted"
    assert first.exit_code == 0
    # Lost: the work since the checkpoint printed on USR1, not since its start.
    assert first.checkpoint_at is not None and first.ended_at is not None
    assert first.lost_work_gpu_s is not None and first.lost_work_gpu_s <= 1
    assert JobEvent.objects.filter(
        job=victim, message__endswith="of work lost since its last checkpoint"
    ).exists()
    # It yielded to the job that needed its GPU; its run up to the checkpoint is
    # charged, the rest is lost work charged to nobody; its owner was told.
    assert first.preempted_for_id == needs.pk
    assert first.lost_since is not None and first.started_at is not None
    [record] = UsageRecord.objects.filter(attempt=first)
    run = (first.ended_at - first.started_at).total_seconds()
    lost = (first.ended_at - first.lost_since).total_seconds()
    assert record.lost_gpu_seconds == pytest.approx(lost, abs=1e-3)
    assert record.gpu_seconds == pytest.approx(run - lost, abs=1e-3)
    [notice] = Delivery.objects.filter(user=alice, kind="job_preempted")
    assert f"its GPUs went to job #{needs.pk}" in notice.text

    # Requeued, not failed, and resumed once the GPU was free again.
    assert wait_for_job(victim.pk, set(Job.TERMINAL)) == "completed"
    victim.refresh_from_db()
    assert victim.preemptions == 1
    assert victim.attempts == 2
    second = Attempt.objects.get(job=victim, number=2)
    needed = Attempt.objects.get(job=needs)
    assert first.ended_at is not None
    assert needed.started_at is not None and second.started_at is not None
    assert first.ended_at <= needed.started_at <= second.started_at
    logs = {
        number: "".join(
            JobLogChunk.objects.filter(attempt__job=victim, attempt__number=number)
            .order_by("offset")
            .values_list("data", flat=True)
        )
        for number in (1, 2)
    }
    assert "restart count: 0" in logs[1]
    assert "GPULAB_CHECKPOINT on USR1" in logs[1]
    assert "restart count: 1" in logs[2]
    assert victim.restarts() == (1, first.lost_work_gpu_s)
