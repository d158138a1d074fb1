"""The ``slurm`` and ``gpulab`` policies: one pass as named stages (``stages``).

``run_multifactor`` builds the pass context and runs the stages in order, timing
each: setup (index, ledger, quotas, quota stops), co-location set-up (evictions),
ordering, placement in order up to the top blocked job, preemption or reservation
for that job, backfill of the jobs after it, and the waiting reasons. What each
stage decides is documented in ``stages``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypeVar

from scheduler.policy import stages
from scheduler.policy.state import (
    STAGE_BACKFILL,
    STAGE_COLOCATION,
    STAGE_ORDERING,
    STAGE_PLACEMENT,
    STAGE_REASONS,
    STAGE_RESERVATION,
    STAGE_SETUP,
    PassResult,
    PassStats,
    Preempt,
    Start,
)

T = TypeVar("T")

if TYPE_CHECKING:
    from collections.abc import Callable

    from scheduler.policy.colocate import Estimator
    from scheduler.policy.state import ClusterState


def run_multifactor(
    state: ClusterState,
    *,
    preemption: bool,
    topology: bool,
    predictions: bool,
    runtime: bool,
    colocation: str | None = None,
    estimator: Estimator | None = None,
) -> PassResult:
    """One pass and its ``PassStats``. ``predictions``: backfill plans jobs with
    min(limit, prediction), not their limits; ``runtime``: the run-time priority
    factor (and class tie-break); ``colocation``: None (never share), "full" (rules
    1-4) or "memory" (memory and count only); ``estimator``: predicts slowdowns
    (default: ``interference.Model`` over ``state.knowledge``; the simulator's
    oracle reads the true table). Stage times come from ``time.perf_counter`` and
    are only reported: no decision reads them."""
    t0 = time.perf_counter()
    p = stages.Pass(
        state,
        preemption=preemption,
        topology=topology,
        predictions=predictions,
        runtime=runtime,
    )
    p.stage_s[STAGE_SETUP] = time.perf_counter() - t0
    _timed(p, STAGE_COLOCATION, stages.share_setup, p, colocation, estimator)
    _timed(p, STAGE_SETUP, stages.stop_overruns, p)
    order = _timed(p, STAGE_ORDERING, stages.ordering, p)
    top, c = _timed(p, STAGE_PLACEMENT, stages.place_in_order, p, order)
    if c is not None:
        _timed(p, STAGE_RESERVATION, stages.reserve_top, p, order[top], c)
        _timed(p, STAGE_BACKFILL, stages.backfill, p, order[top + 1 :])
    _timed(p, STAGE_REASONS, stages.render_waits, p)
    return PassResult(p.decisions, stats(p, len(order)))


def _timed(p: stages.Pass, stage: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, its seconds added to ``stage`` less the time it spent in
    co-location (``stages.share`` counts that under its own stage)."""
    stage_s = p.stage_s
    colo = stage_s.get(STAGE_COLOCATION, 0.0)
    t0 = time.perf_counter()
    out = fn(*args)
    spent = time.perf_counter() - t0 - (stage_s.get(STAGE_COLOCATION, 0.0) - colo)
    stage_s[stage] = stage_s.get(stage, 0.0) + spent
    return out


def stats(p: stages.Pass, considered: int) -> PassStats:
    """The pass's counts (from its decisions), stop reason and stage times."""
    started = backfilled = preempted = 0
    for d in p.decisions:
        if type(d) is Start:
            started += 1
            backfilled += d.backfilled
        elif type(d) is Preempt:
            preempted += 1
    return PassStats(
        considered=considered,
        started=started,
        preempted=preempted,
        reserved=p.reserved,
        backfilled=backfilled,
        stop_reason=p.stop_reason,
        stage_s=p.stage_s,
    )
