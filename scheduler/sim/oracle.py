"""``oracle``: the co-location ceiling, simulator only (never a production policy).

It is ``gpulab`` with the full admission rule (``colocate``), except that its
``Estimator`` reads the ground-truth table instead of learning: r_AB is exactly
1 / norm_a with confidence 1 (so it never explores), and a pair the table marks
infeasible or lacks gets a slowdown no rule admits. It therefore admits exactly the
pairs that satisfy the rules with the true values. It never evicts: its pairs are
within their caps by the table, so an eviction could only come from the noise of the
progress reports (the pass's eviction rule reads measurements). In a cluster of
several GPU models the estimate has no GPU to go by, so it takes the worst of the
cluster's models (a pair infeasible on one of them is refused everywhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.policy import Evict, PassResult
from scheduler.policy.interference import Estimate, Profile
from scheduler.policy.multifactor import run_multifactor

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from scheduler.policy import ClusterState, Decision
    from scheduler.sim.colocation import ColocationTable

NAME = "oracle"
REFUSED = 1e6  # the slowdown of a pair that does not fit: its gain is ~0


class TableEstimator:
    """``colocate.Estimator`` over the true table."""

    def __init__(self, table: ColocationTable, models: Iterable[str]) -> None:
        self.table = table
        self.models = tuple(sorted({m.lower() for m in models}))
        self._cache: dict[tuple[str, str], Estimate] = {}

    def estimate(self, a: Profile, b: Profile) -> Estimate:
        key = (a.workload, b.workload)
        got = self._cache.get(key)
        if got is None:
            norms = [self.table.norm(m, a.workload, b.workload) for m in self.models]
            worst = min((n for n in norms if n is not None), default=None)
            if worst is None or None in norms:
                got = Estimate(REFUSED, 1.0, "oracle", 1)
            else:
                got = Estimate(1.0 / worst, 1.0, "oracle", 1)
            self._cache[key] = got
        return got

    def harmful(self, a: str, b: str) -> bool:
        return False  # it never admits a pair that hurts


def runner(
    table: ColocationTable, models: Iterable[str]
) -> Callable[[ClusterState], PassResult]:
    """``run_pass`` for ``oracle``: gpulab's staged pass, full co-location rule,
    true slowdowns, no evictions."""
    estimator = TableEstimator(table, models)

    def run_oracle(state: ClusterState) -> PassResult:
        got = run_multifactor(
            state,
            preemption=True,
            topology=True,
            predictions=state.config.plans_with_prediction,
            runtime=True,
            colocation="full",
            estimator=estimator,
        )
        kept: list[Decision] = [d for d in got.decisions if not isinstance(d, Evict)]
        return PassResult(kept, got.stats)

    return run_oracle
