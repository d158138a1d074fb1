"""A running job being preempted, as the queue and the job page show it: the
waiting job it yields to and when it will be stopped.

The scheduler records a preemption when it decides it: the victim's live
attempt gets ``kill_reason`` "preempted", the job it yields to
(``Attempt.preempted_for``) and, once the kill went out, ``kill_sent_at``. The
job then has its stop grace (a checkpointable job: its checkpoint signal and
grace, ``scheduler.services.common.kill_terms``) to save its work before it is
killed. The policy plans no preemption ahead of that pass: a job not yet chosen
shows nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.services.common import kill_terms

if TYPE_CHECKING:
    from datetime import datetime

    from scheduler.models import Attempt, Job


@dataclass(frozen=True)
class Yielding:
    for_job_id: int | None  # the waiting job it yields to (None: unknown)
    signal: str  # the first signal it gets ("TERM", "USR1", ...)
    # seconds until it is killed if it has not exited (its grace from the
    # kill's sending); None while the kill has not gone out
    in_s: float | None


def of(job: Job, attempt: Attempt | None, now: datetime) -> Yielding | None:
    """How ``job``'s live ``attempt`` is being preempted, None if it is not."""
    if attempt is None or attempt.ended_at is not None:
        return None
    if attempt.kill_reason != "preempted":
        return None
    grace, signal = kill_terms(job, "preempted")
    in_s = None
    if attempt.kill_sent_at is not None:
        in_s = max(0.0, grace - (now - attempt.kill_sent_at).total_seconds())
    return Yielding(attempt.preempted_for_id, signal, in_s)
