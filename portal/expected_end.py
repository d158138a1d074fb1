"""A running job's expected end as the job page and the API show it: the pass's
own rule (``scheduler.policy.remaining.expected_end``) on the job's live attempt,
so the page says what the scheduler plans with."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from scheduler import services
from scheduler.models import Job
from scheduler.policy.remaining import expected_end, from_reports

if TYPE_CHECKING:
    from scheduler.models import Attempt
    from scheduler.policy import PolicyConfig


@dataclass(frozen=True)
class ExpectedEnd:
    at: datetime
    in_s: float  # from now; 0 when the end is due
    # "progress": from its reported steps and rate; "plan": start + min(limit,
    # prediction); "limit": start + its time limit
    source: str


def _epoch(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def of(
    job: Job,
    attempt: Attempt | None,
    now: datetime,
    config: PolicyConfig | None = None,
) -> ExpectedEnd | None:
    """The expected end of ``job`` running ``attempt`` (its live one), None when
    it is not running. ``config``: the policy's (read from the settings when not
    given); it says whether progress and predictions count (``slurm`` plans with
    limits only)."""
    if job.status != Job.Status.RUNNING or attempt is None or attempt.ended_at:
        return None
    cfg = config or services.policy_config()
    started = (attempt.started_at or attempt.created_at).timestamp()
    at = now.timestamp()
    progress = None
    if cfg.plans_with_progress:
        progress = from_reports(
            attempt.progress_step,
            attempt.progress_total,
            _epoch(attempt.progress_at),
            attempt.progress_first_step,
            _epoch(attempt.progress_first_at),
        )
    limit = float(job.time_limit_s)
    planned = float(job.planned_runtime_s)
    end = expected_end(
        started,
        planned,
        limit,
        at,
        progress,
        predictions=cfg.plans_with_prediction,
    )
    if progress is not None and progress.end(at) is not None:
        source = "progress" if end < started + limit else "limit"
    else:
        source = "limit" if end == started + limit else "plan"
    return ExpectedEnd(datetime.fromtimestamp(end, tz=UTC), max(0.0, end - at), source)
