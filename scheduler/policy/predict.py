"""Run-time prediction from history: one rule for the Celery pass
(``services.predict_runtime``) and the simulator.

The prediction is the longest of the last ``HISTORY`` completed runs of similar jobs
(same user and workload label, else same user; the caller picks the pool). Backfill
plans with min(limit, prediction), and the two errors are not alike: a prediction
that is too long only makes backfill more careful, one that is too short lets a job
jump the queue and then delay the reservation it promised not to delay. The median
is too short for half of the jobs by definition; on the benchmark traces the longest
of the last ten, against the median, halves the reservations that slip and cuts the
average JCT (docs/policy.md). A running job that outlives its prediction is planned
to its limit from then on (``index.PassIndex.planned_end``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

HISTORY = 10  # completed runs a prediction reads, the most recent ones


def predict(recent_runs_s: Iterable[float]) -> float | None:
    """The prediction from the last ``HISTORY`` runs of the pool (the caller cuts
    it); None without history (the job then plans with its limit)."""
    return max(recent_runs_s, default=None)


def planned_runtime(limit_s: float, predicted_s: float | None) -> float:
    """How long a job is planned to run: min(limit, prediction), the limit when
    there is no prediction. What the run-time factor reads and what backfill plans
    with under ``backfill_plan = "prediction"``; one rule for the pass, the job
    page and the simulator."""
    return limit_s if predicted_s is None else min(limit_s, predicted_s)
