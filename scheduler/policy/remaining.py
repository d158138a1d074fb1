"""A running job's expected end: from the progress it reports when it reports
any, else from its plan. One rule for the pass (backfill plans, reservations, the
planned starts shown to waiting jobs), the job page, the API and the simulator.

A job that prints ``GPULAB_PROGRESS step/total`` says how far it is and, over its
attempt, how fast it goes: its remaining time is about (total - step) / rate,
counted from when the latest step was read. That end is capped by the job's limit
(it can never run past it). Without a usable report (no rate yet, a total already
reached, or an end that has already passed while the job still runs) the job's
plan holds: started_at + min(limit, prediction) while that is ahead, else its
limit (Tsafrir et al. 2007), or the limit only where the policy plans with limits
(``slurm``, ``gpulab`` under ``backfill_plan = "limit"``).

A start time shown to a waiting job is a promise, so it is planned with
``shown_end``: an end from progress plus a margin (``SHOWN_MARGIN_S`` and
``SHOWN_MARGIN_SHARE`` of the time left to it), capped by the limit. The rate
over the attempt is an unbiased estimate: planned with it, a start shown a few
minutes ahead is late about as often as early. The pass still plans its
decisions (the shadow time, the backfill guard) with ``expected_end``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Added to an end from progress for the start times shown to waiting jobs: a
# pause of a couple of minutes (an evaluation, a checkpoint) and a tenth of the
# time left (the rate's own error over the rest of the run).
SHOWN_MARGIN_S = 120.0
SHOWN_MARGIN_SHARE = 0.1


@dataclass(frozen=True)
class Progress:
    """What a running job reported over its current attempt: the latest step and
    total, when that step was read (epoch seconds) and its rate in steps per
    second over the attempt (``Attempt.progress_rate``)."""

    step: float
    total: float
    at: float
    rate: float

    def end(self, now: float) -> float | None:
        """When the job reaches its total at its rate so far; None when the rate
        says nothing (not positive), the total is reached (a job that keeps
        running past it is in a phase the steps do not count), or the end is
        already past (``now``) while the job still runs."""
        if self.rate <= 0 or self.total <= 0 or self.step >= self.total:
            return None
        end = self.at + (self.total - self.step) / self.rate
        return end if end > now else None


def planned_end(
    started_at: float,
    planned_s: float,
    time_limit_s: float,
    now: float,
    *,
    predictions: bool,
) -> float:
    """The end from the plan alone: started_at + planned run time while that is
    ahead of ``now`` (``predictions``), else the limit."""
    if predictions:
        end = started_at + planned_s
        if end > now:
            return end
    return started_at + time_limit_s


def expected_end(
    started_at: float,
    planned_s: float,
    time_limit_s: float,
    now: float,
    progress: Progress | None,
    *,
    predictions: bool,
) -> float:
    """The running job's expected end: from ``progress`` when it gives one, never
    past the limit; else ``planned_end``."""
    limit_end = started_at + time_limit_s
    if progress is not None:
        end = progress.end(now)
        if end is not None:
            return min(end, limit_end)
    return planned_end(
        started_at, planned_s, time_limit_s, now, predictions=predictions
    )


def shown_end(
    started_at: float,
    planned_s: float,
    time_limit_s: float,
    now: float,
    progress: Progress | None,
    *,
    predictions: bool,
) -> float:
    """The end planned for the start times shown to waiting jobs: an end from
    ``progress`` is moved later by ``SHOWN_MARGIN_S`` and ``SHOWN_MARGIN_SHARE``
    of the time left to it, never past the limit; an end from the plan is
    ``planned_end``'s (the limit is already an upper bound)."""
    limit_end = started_at + time_limit_s
    if progress is not None:
        end = progress.end(now)
        if end is not None:
            upper = end + SHOWN_MARGIN_S + SHOWN_MARGIN_SHARE * (end - now)
            return min(upper, limit_end)
    return planned_end(
        started_at, planned_s, time_limit_s, now, predictions=predictions
    )


def from_reports(
    step: float | None,
    total: float | None,
    at: float | None,
    first_step: float | None,
    first_at: float | None,
) -> Progress | None:
    """The ``Progress`` of an attempt's stored reports (``Attempt.progress_*``):
    the rate over its window, (latest step - first step) / (latest time - first
    time), as ``Attempt.progress_rate`` computes it; None until two reports some
    time apart with a total."""
    if step is None or total is None or at is None:
        return None
    if first_step is None or first_at is None or at <= first_at:
        return None
    return Progress(
        float(step), float(total), at, (step - first_step) / (at - first_at)
    )
