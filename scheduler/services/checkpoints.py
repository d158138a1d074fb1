"""Checkpointable jobs: the checkpoints a job reports in its output, the work a
requeued attempt lost, and how many times a job was restarted.

A job marks a checkpoint by printing a line ``GPULAB_CHECKPOINT`` (anything may
follow on the line, e.g. the step or the file). The portal notes when such a
line reached it (``Attempt.checkpoint_at``): a checkpointable job stopped to be
requeued then loses only the work since then; any other requeued attempt loses
all of its run (``Attempt.lost_work_gpu_s``, GPU-seconds). Where the scheduler or
an admin stopped it (``UNCHARGED_STOPS``), the lost part is charged to nobody:
``Attempt.lost_since`` marks where it starts, and the charging rule keeps it
apart from the GPU time charged (``UsageRecord.lost_gpu_seconds``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from django.utils import timezone

from scheduler.models import Attempt, Job, JobEvent
from scheduler.services.common import _event

if TYPE_CHECKING:
    from datetime import datetime

PREFIX = "GPULAB_CHECKPOINT"
# The stops whose lost work is charged to nobody (``Attempt.lost_since``): the
# scheduler's (a preemption, an eviction for a GPU partner) and an admin's
# requeue, none of them the owner's choice. A process or node lost is charged
# for what it ran, as an attempt ended when its node was declared lost is.
UNCHARGED_STOPS: frozenset[str] = frozenset({"preempted", "evicted", "requeued"})
# The word at a line's start (spaces or tabs before it), not a longer word.
_LINE = re.compile(r"(?:^|[\r\n])[ \t]*GPULAB_CHECKPOINT(?![A-Za-z0-9_])")


def has_checkpoint(text: str) -> bool:
    """Whether a piece of a job's output holds a ``GPULAB_CHECKPOINT`` line. A
    line split across two pieces is missed; the next checkpoint counts."""
    return PREFIX in text and _LINE.search(text) is not None


def note_checkpoint(attempt_id: int, text: str, now: datetime | None = None) -> bool:
    """Record that the attempt reported a checkpoint if ``text`` (output that
    just arrived) holds one. True if it did."""
    if not has_checkpoint(text):
        return False
    Attempt.objects.filter(pk=attempt_id, ended_at__isnull=True).update(
        checkpoint_at=now or timezone.now()
    )
    return True


def record_lost_work(attempt: Attempt, job: Job, ended: datetime) -> int:
    """Store and return the work (GPU-seconds) an attempt stopped to be requeued
    lost: for a checkpointable job, from its last checkpoint in this attempt (if
    any) to its end ``ended``, else its whole run; a job event says how much. An
    attempt that never started lost nothing. Called before the attempt's end is
    charged (``lifecycle.end_attempt``), in the same transaction: the charge
    reads ``lost_since``, so lost work is never charged, even for a moment."""
    start = attempt.started_at
    at = attempt.checkpoint_at
    since = start
    checkpointed = False
    if start is not None and at is not None and job.checkpointable:
        # The line's arrival (portal time) may trail the agent's exit time: a
        # checkpoint noted after the end was saved at the end.
        since = max(start, min(at, ended))
        checkpointed = True
    lost = 0 if since is None else max(0, round((ended - since).total_seconds()))
    attempt.lost_work_gpu_s = lost * job.gpus
    attempt.lost_since = since if attempt.kill_reason in UNCHARGED_STOPS else None
    attempt.save(update_fields=["lost_work_gpu_s", "lost_since"])
    if start is not None:
        since_text = (
            "since its last checkpoint"
            if checkpointed
            else "since its start"
            + (" (no checkpoint reported)" if job.checkpointable else "")
        )
        _event(
            job,
            f"attempt {attempt.number}: {lost / 60:.0f} min of work lost {since_text}",
            source=JobEvent.Source.SCHEDULER,
            at=ended,
        )
    return attempt.lost_work_gpu_s


def restart_count(attempt: Attempt) -> int:
    """``GPULAB_RESTART_COUNT`` for an attempt: how many earlier attempts of its
    job ran (each ended in a requeue, or there would be no later one). 0 on the
    first start, without a query."""
    if attempt.number <= 1:
        return 0
    return Attempt.objects.filter(
        job_id=attempt.job_id, number__lt=attempt.number, started_at__isnull=False
    ).count()
