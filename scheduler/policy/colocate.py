"""Stage 6: may a shareable job join a GPU that already runs jobs? (SEEDS.md P1-P3)

A candidate joins a GPU only if all of these hold, checked in this order; the
first that fails is the refusal's rule, and an admission records its numbers:

- ``count`` (rule 4): fewer jobs on the GPU than its slots (``GPULAB_GPU_JOB_LIMIT``);
- ``exclusive``: every job on it, and the candidate, is shareable;
- ``memory`` (rule 1, P1): each job's need (the larger of its declared memory and its
  measured peak, plus ``colo_headroom_mib``) summed fits the GPU; a job with neither
  a declaration nor a measurement cannot share (its need is unknown);
- ``unknown`` / ``budget``: every ordered pair's estimate (``interference.Model``)
  is at least ``colo_min_confidence`` sure, else the admission is an exploration
  trial, allowed while the pair's and the cluster's trial budgets for the last hour
  last (``colo_trials_per_pair_hour``, ``colo_trials_per_hour``): without trials
  nothing is learned, without a budget users pay for it. A trial is judged on its
  predicted gain only (rule 2 with the prior); the cap is enforced by watching it
  (the pass ends a trial whose measured slowdown is over a cap);
- ``gain`` (rule 2, P2): for every pair on the GPU, 1/r_AB + 1/r_BA > 1 +
  ``colo_gain_margin`` (at margin 0 exactly r_AB * r_BA < r_AB + r_BA: sharing beats
  taking turns). A cap below 2 already implies it; it is what guards caps of 2 or more;
- ``protection`` (rule 3, P3): each job's predicted slowdown (the product of its
  slowdowns beside each partner) is within its cap (class cap, or the tighter one
  its owner asked for; None: unbounded).

Among the GPUs that admit, the best gain wins, then the partner closest in size
(declared memory, P3's "similar size"), then the lowest GPU id: deterministic.
Pure: no Django, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from scheduler.policy.interference import Estimate, Profile, gain

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from scheduler.policy.state import PolicyConfig


class Estimator(Protocol):
    """``interference.Model``, or anything that predicts r_AB the same way."""

    def estimate(self, a: Profile, b: Profile) -> Estimate: ...


@dataclass(frozen=True)
class Sharer:
    """A job as the admission rule sees it (the candidate or one already on the
    GPU)."""

    id: int
    profile: Profile
    shareable: bool = True
    peak_memory_mib: int | None = None  # measured while it ran (residents)
    cap: float | None = 1.5  # slowdown cap; None: unbounded

    def need_mib(self, headroom_mib: int) -> int | None:
        declared = self.profile.memory_mib
        if declared is None and self.peak_memory_mib is None:
            return None
        return max(declared or 0, self.peak_memory_mib or 0) + headroom_mib


@dataclass(frozen=True)
class Admission:
    """One admission decision: ``rule`` is the rule that refused it, or "ok" /
    "trial" when admitted; ``message`` says it to a person."""

    job_id: int
    gpu_id: int
    admitted: bool
    rule: str
    message: str
    slowdowns: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    gain: float | None = None  # the worst pair's 1/r_AB + 1/r_BA
    confidence: float | None = None  # the least sure pair's
    trial: bool = False
    partners: tuple[int, ...] = ()


@dataclass
class Budget:
    """Exploration trials left this pass: per unordered workload pair and in all
    (started trials in the last hour are subtracted by the caller)."""

    per_pair: int
    total: int
    used: Mapping[frozenset[str], int] = field(default_factory=dict)

    def allows(self, pair: frozenset[str]) -> bool:
        return self.total > 0 and self.used.get(pair, 0) < self.per_pair

    def spend(self, pair: frozenset[str]) -> None:
        self.total -= 1
        used = dict(self.used)
        used[pair] = used.get(pair, 0) + 1
        self.used = used


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB"


def admit(
    job: Sharer,
    residents: Sequence[Sharer],
    *,
    gpu_id: int,
    memory_total_mib: int,
    slots: int,
    model: Estimator,
    config: PolicyConfig,
    budget: Budget,
) -> Admission:
    """Whether ``job`` may join ``residents`` on one GPU (it does not spend the
    budget: the caller does, for the admission it keeps)."""

    def refuse(rule: str, message: str, *, numbers: bool = False) -> Admission:
        if not numbers:
            return Admission(job.id, gpu_id, admitted=False, rule=rule, message=message)
        return Admission(
            job.id,
            gpu_id,
            admitted=False,
            rule=rule,
            message=message,
            slowdowns=frozen,
            gain=worst_gain,
            confidence=confidence,
            trial=trial,
            partners=partners,
        )

    partners = tuple(r.id for r in residents)
    if len(residents) + 1 > slots:
        return refuse(
            "count", f"it already runs {len(residents)} job(s), its limit is {slots}"
        )
    if not job.shareable:
        return refuse("exclusive", "the job asked for a GPU of its own")
    for r in residents:
        if not r.shareable:
            return refuse("exclusive", f"job {r.id} asked for a GPU of its own")
    headroom = config.colo_headroom_mib
    needs = [(s, s.need_mib(headroom)) for s in (job, *residents)]
    for s, need in needs:
        if need is None:
            return refuse(
                "memory",
                f"job {s.id} declares no GPU memory and none was measured, so its"
                " need is unknown",
            )
    total = sum(n for _, n in needs if n is not None)
    if total > memory_total_mib:
        parts = " + ".join(_gib(n) for _, n in needs if n is not None)
        return refuse(
            "memory",
            f"memory {parts} (with {headroom} MiB headroom each) is over the GPU's"
            f" {_gib(memory_total_mib)}",
        )

    # predicted slowdowns, pair by pair
    group = (job, *residents)
    est: dict[tuple[int, int], Estimate] = {}
    for a in group:
        for b in group:
            if a.id != b.id:
                est[a.id, b.id] = model.estimate(a.profile, b.profile)
    confidence = min(e.confidence for e in est.values())
    worst_gain = math.inf
    worst_pair = (job.id, job.id)
    for a in group:
        for b in group:
            if a.id < b.id:
                g = gain(est[a.id, b.id].slowdown, est[b.id, a.id].slowdown)
                if g < worst_gain:
                    worst_gain, worst_pair = g, (a.id, b.id)
    slowdowns = {
        a.id: math.prod(est[a.id, b.id].slowdown for b in group if b.id != a.id)
        for a in group
    }
    frozen = MappingProxyType(slowdowns)
    need_gain = 1.0 + config.colo_gain_margin
    trial = confidence < config.colo_min_confidence
    if trial:
        pairs = {
            frozenset((job.profile.workload, r.profile.workload)) for r in residents
        }
        if not all(budget.allows(p) for p in pairs):
            return refuse(
                "budget",
                f"the pair is not known well enough (confidence {confidence:.2f},"
                f" needs {config.colo_min_confidence:.2f}) and the exploration"
                " budget for this hour is spent",
                numbers=True,
            )
    a_id, b_id = worst_pair
    if worst_gain <= need_gain:
        return refuse(
            "gain",
            f"jobs {a_id} and {b_id} together would do {worst_gain:.2f} GPUs' worth"
            f" of work, not over the {need_gain:.2f} that sharing must beat"
            + (" (prior, untried pair)" if trial else ""),
            numbers=True,
        )
    if not trial:
        for s in group:
            if s.cap is not None and slowdowns[s.id] > s.cap:
                return refuse(
                    "protection",
                    f"job {s.id} would run {slowdowns[s.id]:.2f}x slower, over its"
                    f" cap of {s.cap:g}x",
                    numbers=True,
                )
    shown = ", ".join(f"job {k} {v:.2f}x" for k, v in slowdowns.items())
    if trial:
        message = (
            f"exploration trial: the pair is new (confidence {confidence:.2f});"
            f" predicted gain {worst_gain:.2f}, slowdowns {shown}; ended early if"
            " a job runs slower than its cap"
        )
    else:
        message = f"predicted gain {worst_gain:.2f}, slowdowns {shown}"
    return Admission(
        job.id,
        gpu_id,
        admitted=True,
        rule="trial" if trial else "ok",
        message=message,
        slowdowns=frozen,
        gain=worst_gain,
        confidence=confidence,
        trial=trial,
        partners=partners,
    )


def rank(
    admission: Admission, job: Sharer, residents: Sequence[Sharer]
) -> tuple[bool, float, float, int]:
    """Sort key among admitting GPUs (smaller first): known pairs before trials,
    then the best gain, then the partner closest in size, then the GPU id."""
    m = job.profile.memory_mib or 0
    closeness = min(
        (abs(math.log((r.profile.memory_mib or 1) / (m or 1))) for r in residents),
        default=0.0,
    )
    return (
        admission.trial,
        -(admission.gain or 0.0),
        closeness,
        admission.gpu_id,
    )
