"""The co-location stage: may a shareable job join a GPU that already runs jobs? (SEEDS.md P1-P3)

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
  predicted gain only (rule 2 with the prior) while the pair was never observed
  together; the cap is enforced by watching it (the pass ends a trial at its first
  measurement clearly over a cap, else within ``colo_detect_window_s``), and once
  observed, rule 3 applies too;
- ``odds`` (when ``colo_trial_min_odds`` is set): a trial's pair must have those
  odds of being admissible once seen, from the pairs tried so far
  (``interference.Outcomes``); when ``colo_trial_max_failures`` (k) is set, a
  trial's family pair must not have failed k times with no win, and its odds
  rank the trials;
- ``gain`` (rule 2, P2): for every pair on the GPU, 1/r_AB + 1/r_BA > 1 +
  ``colo_gain_margin`` (at margin 0 exactly r_AB * r_BA < r_AB + r_BA: sharing beats
  taking turns). A cap below 2 already implies it; it is what guards caps of 2 or more.
  A trial's predicted gain must clear ``colo_trial_gain_margin`` when that is higher;
- ``protection`` (rule 3, P3): each job's predicted slowdown (the product of its
  slowdowns beside each partner), plus ``colo_cap_margin``, is within its cap
  (class cap, or the tighter one its owner asked for; None: unbounded). A pair
  seen in fewer than ``colo_retrial_episodes`` episodes that is over a cap by
  less than ``colo_retrial_z`` standard errors of its record is admitted as a
  re-trial instead, within the trial budget (``_retrial``).

Among the GPUs that admit, known pairs come before trials, trials with the best
odds first when ranked by them, then the best gain wins, then the partner closest in size
(declared memory, P3's "similar size"), then the lowest GPU id: deterministic.
Pure: no Django, no I/O.
"""

from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from scheduler.policy.interference import (
    Estimate,
    Observations,
    Odds,
    Outcomes,
    Profile,
    clamp_log,
    gain,
    noise_for,
    outcomes_for,
)
from scheduler.policy.state import Evict, is_interactive

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from scheduler.policy.index import Constraint, PassIndex
    from scheduler.policy.state import (
        ClusterState,
        PendingJob,
        PolicyConfig,
        RunningJob,
    )


class Estimator(Protocol):
    """``interference.Model``, or anything that predicts r_AB the same way."""

    def estimate(self, a: Profile, b: Profile) -> Estimate: ...

    def harmful(self, a: str, b: str) -> bool:
        """Workloads ``a`` and ``b`` were seen to hurt each other over a cap."""
        ...


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
    # the workload labels: the job's, then its partners' (in ``partners`` order)
    workloads: tuple[str, ...] = ()
    # a trial's odds of its pair turning out admissible (the worst partner's),
    # when ``colo_trial_max_failures`` ranks trials by them
    odds: float | None = None


@dataclass
class Budget:
    """Exploration trials left this pass: per unordered workload pair and in all
    (started trials in the last hour are subtracted by the caller)."""

    per_pair: int
    total: int
    used: dict[frozenset[str], int] = field(default_factory=dict)  # its own copy

    def allows(self, pair: frozenset[str]) -> bool:
        return self.total > 0 and self.used.get(pair, 0) < self.per_pair

    def spend(self, pair: frozenset[str]) -> None:
        self.total -= 1
        self.used[pair] = self.used.get(pair, 0) + 1


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
    rules: str = "full",
    outcomes: Outcomes | None = None,
    noise: float | None = None,
) -> Admission:
    """Whether ``job`` may join ``residents`` on one GPU (it does not spend the
    budget: the caller does, for the admission it keeps). ``rules``: "full", or
    "memory" for count, exclusive and memory only (``pack-by-memory``);
    ``outcomes``: the pairs tried so far, which a trial's odds are read from
    (None: a trial is judged without them)."""
    partners = tuple(r.id for r in residents)
    workloads = (job.profile.workload, *(r.profile.workload for r in residents))
    refused = _fit_refusal(job, residents, slots, memory_total_mib, config, model)
    if refused is not None:
        rule, message = refused
        return Admission(
            job.id,
            gpu_id,
            admitted=False,
            rule=rule,
            message=message,
            partners=partners,
            workloads=workloads,
        )
    if rules == "memory":
        return Admission(
            job.id,
            gpu_id,
            admitted=True,
            rule="memory-only",
            message="memory and job count allow it (pack-by-memory)",
            partners=partners,
            workloads=workloads,
        )
    p = _Prediction.of(job, residents, model, config)
    rule, message, odds = _judge(job, p, config, budget, outcomes, noise)
    return Admission(
        job.id,
        gpu_id,
        admitted=rule in ("ok", "trial"),
        rule=rule,
        message=message,
        partners=partners,
        workloads=workloads,
        slowdowns=MappingProxyType(p.slowdowns),
        gain=p.worst_gain,
        confidence=p.confidence,
        trial=p.trial or rule == "trial",
        odds=odds,
    )


def _fit_refusal(
    job: Sharer,
    residents: Sequence[Sharer],
    slots: int,
    memory_total_mib: int,
    config: PolicyConfig,
    model: Estimator,
) -> tuple[str, str] | None:
    """The rules that need no prediction, in order: ``count``, ``exclusive``,
    ``memory``, and ``protection`` for a pair marked harmful; (rule, message) of
    the first that refuses, else None."""
    if len(residents) + 1 > slots:
        return "count", f"it already runs {len(residents)} job(s), its limit is {slots}"
    if not job.shareable:
        return "exclusive", "the job asked for a GPU of its own"
    for r in residents:
        if not r.shareable:
            return "exclusive", f"job {r.id} asked for a GPU of its own"
    headroom = config.colo_headroom_mib
    needs = [(s, s.need_mib(headroom)) for s in (job, *residents)]
    for s, need in needs:
        if need is None:
            return (
                "memory",
                f"job {s.id} declares no GPU memory and none was measured, so its"
                " need is unknown",
            )
    total = sum(n for _, n in needs if n is not None)
    if total > memory_total_mib:
        parts = " + ".join(_gib(n) for _, n in needs if n is not None)
        return (
            "memory",
            f"memory {parts} (with {headroom} MiB headroom each) is over the GPU's"
            f" {_gib(memory_total_mib)}",
        )
    for r in residents:
        if model.harmful(job.profile.workload, r.profile.workload):
            return (
                "protection",
                f"this pair of workloads ({job.profile.workload or 'unlabelled'},"
                f" {r.profile.workload or 'unlabelled'}) ran over a cap or out of"
                " memory when it shared before: it is not admitted again until an"
                " admin resets it",
            )
    return None


@dataclass(frozen=True)
class _Prediction:
    """The estimates for one candidate GPU: each job's predicted slowdown (the
    product over its partners), the worst pair's gain, the least confidence."""

    residents: Sequence[Sharer]
    slowdowns: dict[int, float]
    worst_gain: float
    worst_pair: tuple[int, int]
    confidence: float
    trial: bool  # confidence under ``colo_min_confidence``
    observed: bool  # some pair was seen together
    episodes: int  # the fewest episodes any ordered pair of the GPU was seen in

    @classmethod
    def of(
        cls,
        job: Sharer,
        residents: Sequence[Sharer],
        model: Estimator,
        config: PolicyConfig,
    ) -> _Prediction:
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
        return cls(
            residents,
            slowdowns,
            worst_gain,
            worst_pair,
            confidence,
            trial=confidence < config.colo_min_confidence,
            observed=any(e.observations > 0 for e in est.values()),
            episodes=min(e.observations for e in est.values()),
        )


def _judge(
    job: Sharer,
    p: _Prediction,
    config: PolicyConfig,
    budget: Budget,
    outcomes: Outcomes | None = None,
    noise: float | None = None,
) -> tuple[str, str, float | None]:
    """The predicted rules, in order: ``budget`` and ``odds`` (a trial needs
    both), ``gain``, ``protection``; (rule, message, a trial's odds when
    ``colo_trial_max_failures`` ranks by them), the rule "ok" or "trial" when
    admitted."""
    confidence, worst_gain, trial = p.confidence, p.worst_gain, p.trial
    # a trial is judged on a prediction, not an observation: it must clear the
    # higher bar, so that pairs predicted to gain barely are not tried
    need_gain = 1.0 + (
        max(config.colo_gain_margin, config.colo_trial_gain_margin)
        if trial
        else config.colo_gain_margin
    )
    odds: float | None = None
    if trial:
        if not _budget_allows(job, p.residents, budget):
            return (
                "budget",
                f"the pair is not known well enough (confidence {confidence:.2f},"
                f" needs {config.colo_min_confidence:.2f}) and the exploration"
                " budget for this hour is spent",
                None,
            )
        refused = _odds_refusal(job, p.residents, config, outcomes)
        if refused is None:
            refused, odds = _failures_refusal(job, p.residents, config, outcomes)
        if refused is not None:
            return "odds", refused, None
    a_id, b_id = p.worst_pair
    if worst_gain <= need_gain:
        return (
            "gain",
            f"jobs {a_id} and {b_id} together would do {worst_gain:.2f} GPUs' worth"
            f" of work, not over the {need_gain:.2f} that sharing must beat"
            + (" (prior, untried pair)" if trial else ""),
            None,
        )
    # a trial is judged on gain alone only while its pair was never seen together:
    # once observed, the observation speaks for the caps
    if not trial or p.observed:
        margin = 1.0 + config.colo_cap_margin
        over = [
            s
            for s in (job, *p.residents)
            if s.cap is not None and p.slowdowns[s.id] * margin > s.cap
        ]
        if over:
            s = over[0]
            refusal = (
                "protection",
                f"job {s.id} would run {p.slowdowns[s.id]:.2f}x slower, over its"
                f" cap of {s.cap:g}x",
                None,
            )
            if not _retrial(p, over, margin, config, noise) or not _budget_allows(
                job, p.residents, budget
            ):
                return refusal
            seen = f"{p.episodes} episode{'s' if p.episodes != 1 else ''}"
            return (
                "trial",
                f"re-trial: the pair was seen in {seen}, slowdowns {_shown(p)}, within"
                f" {config.colo_retrial_z:g} standard errors of a cap; ended early"
                " if a job runs slower than its cap",
                None,
            )
    shown = _shown(p)
    if trial:
        return (
            "trial",
            f"exploration trial: the pair is new (confidence {confidence:.2f});"
            f" predicted gain {worst_gain:.2f}, slowdowns {shown}"
            + (f", odds {odds:.2f}" if odds is not None else "")
            + "; ended early if a job runs slower than its cap",
            odds,
        )
    return "ok", f"predicted gain {worst_gain:.2f}, slowdowns {shown}", None


def _shown(p: _Prediction) -> str:
    """The predicted slowdowns as an admission's message gives them."""
    return ", ".join(f"job {k} {v:.2f}x" for k, v in p.slowdowns.items())


def _budget_allows(job: Sharer, residents: Sequence[Sharer], budget: Budget) -> bool:
    """The trial budget has room for a trial of ``job`` beside each resident."""
    return all(
        budget.allows(frozenset((job.profile.workload, r.profile.workload)))
        for r in residents
    )


def _retrial(
    p: _Prediction,
    over: Sequence[Sharer],
    margin: float,
    config: PolicyConfig,
    noise: float | None,
) -> bool:
    """Whether a pair seen before and refused for protection is tried again: while
    it was seen in fewer than ``colo_retrial_episodes`` episodes, and every job it
    puts over its cap (with the cap margin) would be within it but for
    ``colo_retrial_z`` standard errors of its record (the pooled episode noise
    over the square root of its episodes). One short episode measured a few per
    cent high (its reports' noise is 2-3 % over five minutes) would otherwise
    refuse a pair that gains 40 % for good; the re-trial is watched like any
    trial, spends the trial budget, and its episode joins the record."""
    z = config.colo_retrial_z
    if z is None or noise is None or p.episodes >= config.colo_retrial_episodes:
        return False
    slack = math.exp(z * noise / math.sqrt(max(p.episodes, 1)))
    return all(
        s.cap is not None and p.slowdowns[s.id] * margin <= s.cap * slack for s in over
    )


def _pair_odds(
    job: Sharer,
    resident: Sharer,
    config: PolicyConfig,
    outcomes: Outcomes,
    *,
    itself: bool = False,
) -> Odds:
    """The odds that ``job`` beside ``resident`` turns out admissible once
    observed (``Outcomes.odds``), under the tighter of their caps and the
    admission's margins."""
    caps = [c for c in (job.cap, resident.cap) if c is not None]
    return outcomes.odds(
        job.profile.workload,
        resident.profile.workload,
        cap=min(caps) if caps else None,
        need_gain=1.0 + config.colo_gain_margin,
        cap_margin=config.colo_cap_margin,
        itself=itself,
    )


def _odds_refusal(
    job: Sharer,
    residents: Sequence[Sharer],
    config: PolicyConfig,
    outcomes: Outcomes | None,
) -> str | None:
    """Why a trial beside ``residents`` is not worth its cost: for some pair,
    the pairs tried so far give it odds under ``colo_trial_min_odds`` of being
    admissible once observed (``interference.Outcomes``); None when all pass."""
    if outcomes is None or config.colo_trial_min_odds <= 0:
        return None
    for r in residents:
        got = _pair_odds(job, r, config, outcomes)
        if got.p < config.colo_trial_min_odds:
            fa, fb = got.families
            return (
                f"pairs like this one rarely share well: of {got.tried} tried"
                f" pair(s) of {fa or 'unlabelled'} and {fb or 'unlabelled'},"
                f" {got.wins} could share within the caps; with the other tried"
                f" pairs the odds are {got.p:.2f}, a trial needs"
                f" {config.colo_trial_min_odds:.2f}"
            )
    return None


def _failures_refusal(
    job: Sharer,
    residents: Sequence[Sharer],
    config: PolicyConfig,
    outcomes: Outcomes | None,
) -> tuple[str | None, float | None]:
    """(why a trial beside ``residents`` is refused: some partner's family pair
    failed ``colo_trial_max_failures`` times with no win, else None; the worst
    partner's odds, which rank the trials). Off (None, None) when the knob is 0."""
    k = config.colo_trial_max_failures
    if outcomes is None or k <= 0:
        return None, None
    worst: float | None = None
    for r in residents:
        got = _pair_odds(job, r, config, outcomes, itself=True)
        if got.wins == 0 and got.tried >= k:
            fa, fb = got.families
            what = (
                f"a workload of {fa or 'unlabelled'} with itself"
                if job.profile.workload == r.profile.workload
                else f"{fa or 'unlabelled'} and {fb or 'unlabelled'}"
            )
            return (
                f"pairs like this one did not share well: {got.tried} tried pair(s)"
                f" of {what} failed, none"
                f" could share within the caps (a family pair is tried until {k}"
                " fail with no success)",
                None,
            )
        worst = got.p if worst is None else min(worst, got.p)
    return None, worst


def rank(
    admission: Admission, job: Sharer, residents: Sequence[Sharer]
) -> tuple[bool, float, float, float, int]:
    """Sort key among admitting GPUs (smaller first): known pairs before trials,
    then a trial's best odds (when ranked by them), then the best gain, then the
    partner closest in size, then the GPU id."""
    m = job.profile.memory_mib or 0
    closeness = min(
        (abs(math.log((r.profile.memory_mib or 1) / (m or 1))) for r in residents),
        default=0.0,
    )
    return (
        admission.trial,
        -(admission.odds or 0.0),
        -(admission.gain or 0.0),
        closeness,
        admission.gpu_id,
    )


# ------------------------------------------------------------------ the pass's side

_RULE_RANK = {
    "protection": 6,
    "gain": 5,
    "odds": 4,
    "budget": 3,
    "memory": 2,
    "exclusive": 1,
}


class Sharing:
    """The co-location stage's state for one pass: the GPUs a shareable single-GPU job may join
    (those whose every job is a shareable single-GPU one, not stopping, below the
    GPU's slots, on a schedulable node), grouped by what runs on them so that a
    job is judged once per kind of GPU, not once per GPU."""

    def __init__(
        self,
        state: ClusterState,
        idx: PassIndex,
        model: Estimator,
        rules: str,
        evicted: frozenset[int] = frozenset(),
    ) -> None:
        cfg = state.config
        self.config = cfg
        self.idx = idx
        self.model = model
        self.rules = rules
        self.outcomes = outcomes_for(state.knowledge)
        if cfg.colo_trial_min_odds > 0 or cfg.colo_trial_max_failures > 0:
            self.outcomes = self.outcomes.with_live(live_trials(state))
        used = dict(state.trials_last_hour)
        self.budget = Budget(
            cfg.colo_trials_per_pair_hour,
            cfg.colo_trials_per_hour - sum(used.values()),
            used,
        )
        self.residents: dict[int, list[Sharer]] = {}
        blocked: set[int] = set()
        for r in state.running:
            if len(r.gpu_ids) != 1 or not r.shareable or r.stopping or r.id in evicted:
                blocked.update(r.gpu_ids)
                continue
            self.residents.setdefault(r.gpu_ids[0], []).append(
                Sharer(
                    r.id,
                    Profile(r.workload, r.gpu_memory_mib),
                    peak_memory_mib=r.peak_memory_mib,
                    cap=r.slowdown_cap,
                )
            )
        self.free: dict[int, int] = {}  # slots left, by GPU
        self.groups: dict[tuple[object, ...], list[int]] = {}
        self.sig_of: dict[int, tuple[object, ...]] = {}
        for gid, rs in self.residents.items():
            gpu = idx.gpu_by_id.get(gid)
            if gid in blocked or gpu is None or not gpu.schedulable:
                continue
            if gpu.node_id not in idx.schedulable_nodes:
                continue
            free = min(gpu.free_slots, gpu.slots - len(rs))
            if free > 0:
                self.free[gid] = free
                self._file(gid)
        self._cache: dict[tuple[object, ...], Admission] = {}
        self.noise = (
            noise_for(state.knowledge) if cfg.colo_retrial_z is not None else None
        )

    def _signature(self, gid: int) -> tuple[object, ...]:
        gpu = self.idx.gpu_by_id[gid]
        rs = self.residents[gid]
        return (
            gpu.memory_total_mib,
            gpu.model,
            gpu.slots,
            self.free[gid],
            tuple(
                sorted(
                    (
                        s.profile.workload,
                        s.profile.memory_mib or -1,
                        s.peak_memory_mib or -1,
                        -1.0 if s.cap is None else s.cap,
                    )
                    for s in rs
                )
            ),
        )

    def _file(self, gid: int) -> None:
        sig = self._signature(gid)
        self.sig_of[gid] = sig
        insort(self.groups.setdefault(sig, []), gid)

    def _unfile(self, gid: int) -> None:
        sig = self.sig_of.pop(gid, None)
        if sig is None:
            return
        gids = self.groups[sig]
        gids.remove(gid)
        if not gids:
            del self.groups[sig]

    def _admit(self, job: Sharer, gid: int) -> Admission:
        gpu = self.idx.gpu_by_id[gid]
        return admit(
            job,
            self.residents[gid],
            gpu_id=gid,
            memory_total_mib=gpu.memory_total_mib,
            slots=len(self.residents[gid]) + self.free[gid],
            model=self.model,
            config=self.config,
            budget=self.budget,
            rules=self.rules,
            outcomes=self.outcomes,
            noise=self.noise,
        )

    def try_share(
        self, job: PendingJob, c: Constraint, exclude: frozenset[int]
    ) -> tuple[Admission | None, Admission | None]:
        """(the admission to apply, else None; the most telling refusal, if any).
        An admission is kept: the caller must start the job on its GPU."""
        if job.gpus != 1 or not self.groups:
            return None, None
        me = Sharer(
            job.id,
            Profile(job.workload, job.gpu_memory_mib),
            shareable=job.shareable,
            cap=job.slowdown_cap,
        )
        jkey = (job.workload, job.gpu_memory_mib, job.shareable, job.slowdown_cap)
        matching = self.idx.view(c).matching
        best: tuple[tuple[bool, float, float, float, int], int] | None = None
        refusal: Admission | None = None
        refused_on = -1  # the GPU of this pass the refusal was judged for
        for sig, gids in self.groups.items():
            gid = next((g for g in gids if g not in exclude and g in matching), None)
            if gid is None:
                continue
            key = (jkey, sig)
            got = self._cache.get(key)
            if got is None:
                got = self._cache[key] = self._admit(me, gid)
            elif got.trial and not all(
                self.budget.allows(frozenset((got.workloads[0], w)))
                for w in got.workloads[1:]
            ):
                # the budget only shrinks in a pass: a cached trial may be spent
                got = replace(got, admitted=False, rule="budget", trial=False)
            if got.admitted:
                k = rank(got, me, self.residents[gid])
                k = (*k[:4], gid)
                if best is None or k < best[0]:
                    best = (k, gid)
            elif refusal is None or _RULE_RANK.get(got.rule, 0) > _RULE_RANK.get(
                refusal.rule, 0
            ):
                refusal, refused_on = got, gid
        if best is None:
            if refusal is not None:
                # a cached twin names another job and a GPU that may be full by
                # now: judge again on the GPU this pass looked at
                refusal = self._admit(me, refused_on)
            return None, refusal
        gid = best[1]
        adm = self._admit(me, gid)
        if not adm.admitted:  # pragma: no cover - the cached twin admitted
            return None, adm
        if adm.trial:
            for r in self.residents[gid]:
                self.budget.spend(frozenset((job.workload, r.profile.workload)))
        self.join(gid, me)
        return adm, None

    def join(self, gid: int, sharer: Sharer) -> None:
        """``sharer`` now runs on ``gid`` (a shared start, or a shareable job
        started alone this pass on a GPU with ``free`` slots left)."""
        self._unfile(gid)
        self.residents.setdefault(gid, []).append(sharer)
        left = self.free.get(gid, 0) - 1
        if left > 0:
            self.free[gid] = left
            self._file(gid)
        else:
            self.free.pop(gid, None)

    def started_alone(self, job: PendingJob, gid: int) -> None:
        """A shareable single-GPU job started on a free GPU this pass: a later job
        of the pass may join it."""
        gpu = self.idx.gpu_by_id.get(gid)
        if gpu is None or gpu.slots < 2 or not job.shareable:
            return
        self.residents[gid] = [
            Sharer(
                job.id,
                Profile(job.workload, job.gpu_memory_mib),
                cap=job.slowdown_cap,
            )
        ]
        self.free[gid] = gpu.slots - 1
        self._file(gid)


def live_trials(state: ClusterState) -> dict[frozenset[str], tuple[float, float]]:
    """The verdict so far of each exploration trial still running: per unordered
    workload pair of a GPU shared by two jobs whose later one joined as a trial,
    once both were measured for half of ``colo_detect_window_s`` (when the
    eviction rule would have ended it over a cap), (combined normalised
    throughput, worst slowdown) as measured. What the trial odds read beside
    the pairs' records (``interference.Outcomes.with_live``)."""
    by_gpu: dict[int, list[RunningJob]] = {}
    for r in state.running:
        if len(r.gpu_ids) == 1 and r.shareable and not r.stopping:
            by_gpu.setdefault(r.gpu_ids[0], []).append(r)
    need = state.config.colo_detect_window_s / 2
    out: dict[frozenset[str], tuple[float, float]] = {}
    for rs in by_gpu.values():
        if len(rs) != 2 or not rs[0].workload or not rs[1].workload:
            continue
        later = max(rs, key=lambda r: (r.joined_at or 0.0, r.id))
        if later.joined_at is None or not later.trial:
            continue
        a, b = rs
        if a.measured_slowdown is None or b.measured_slowdown is None:
            continue
        if min(a.measured_for_s, b.measured_for_s) < need:
            continue
        r_a, r_b = a.measured_slowdown, b.measured_slowdown
        out[frozenset((a.workload, b.workload))] = (gain(r_a, r_b), max(r_a, r_b))
    return out


# A current measurement this many episode noises (of a prediction from the pair's
# record) off that record is not the pair the record describes (one label over
# two configurations, a changed input pipeline): it is judged by itself alone.
OUTLIER_Z = 4.0


@dataclass(frozen=True)
class Judged:
    """What the eviction rule judges a shared job by: its log slowdown and the
    standard error of that figure; ``episodes``: how many earlier episodes of
    its pair went into it (0: the current episode's measurement alone)."""

    log_slowdown: float
    se: float | None = None
    episodes: int = 0

    @property
    def slowdown(self) -> float:
        return math.exp(self.log_slowdown)


def _judged(
    r: RunningJob,
    history: Observations | None,
    noise: float | None,
    config: PolicyConfig,
) -> Judged | None:
    """``r``'s slowdown as the eviction rule reads it. With ``colo_evict_z`` set,
    the pair observed before (``history``, r's workload beside its partner's)
    and the episode noise known (``interference.episode_noise``): the mean of
    the earlier episodes and the current measurement, each counted as one
    episode, with standard error noise / sqrt(episodes + 1). A pair's slowdown
    is a property of the pair, so its history says more about it than five
    minutes of noisy reports: judged on those alone, a pair truly a few per cent
    under its cap is measured within ``colo_cap_margin`` of it time and again,
    evicted, admitted again on its record and evicted again. Otherwise, or when
    the measurement is more than ``OUTLIER_Z`` noises (noise * sqrt(1 + 1/n)) off
    the record's mean, the current measurement alone, with no standard error."""
    if r.measured_slowdown is None or r.slowdown_cap is None:
        return None
    x = clamp_log(math.log(max(r.measured_slowdown, 1e-9)))
    if (
        config.colo_evict_z is None
        or history is None
        or history.n <= 0
        or noise is None
    ):
        return Judged(x)
    n = history.n
    if abs(x - history.mean) > OUTLIER_Z * noise * math.sqrt(1.0 + 1.0 / n):
        return Judged(x)
    return Judged((history.mean * n + x) / (n + 1), noise / math.sqrt(n + 1), n)


def _over_cap(
    r: RunningJob, judged: Judged | None, config: PolicyConfig, *, trial: bool
) -> bool:
    """``r`` was measured too slow long enough to act: for half of the detection
    window, over its cap less ``colo_cap_margin`` (the margin admission keeps a
    prediction under the cap by: a job truly a hair over its cap is measured about
    as often under it as over, so "not measured over" would leave it over its cap
    past the window), or, when its pair's history is in ``judged``, its judged
    slowdown plus ``colo_evict_z`` standard errors over the cap; or, in an
    exploration trial, at its first measurement when
    it is over the cap by more than ``colo_trial_evict_margin`` when set (noise on
    a few reports is a few per cent; a trial's pair was never seen, so nothing
    predicted it within the cap)."""
    if judged is None or r.slowdown_cap is None:
        return False
    if r.measured_for_s >= config.colo_detect_window_s / 2:
        if judged.se is not None and config.colo_evict_z is not None:
            return judged.log_slowdown + config.colo_evict_z * judged.se > math.log(
                r.slowdown_cap
            )
        return judged.slowdown * (1.0 + config.colo_cap_margin) > r.slowdown_cap
    margin = config.colo_trial_evict_margin
    if not trial or margin is None:
        return False
    return judged.slowdown > r.slowdown_cap * (1.0 + margin)


def _unmeasured(
    rs: Sequence[RunningJob], later: RunningJob, state: ClusterState
) -> RunningJob | None:
    """In an exploration trial (``later`` joined as one), a capped job still not
    measured half the detection window after the trial began: nothing predicted
    the untried pair within the caps, and a slowdown that cannot be measured
    cannot be kept within them (P3), so the trial ends like one measured over a
    cap. A slowdown is measured against the workload's speed alone, so a workload
    never seen running alone, or a job that reports no progress, stays
    unmeasured. None when every capped job was measured, or it is too soon."""
    if not later.trial or later.joined_at is None:
        return None
    if state.now - later.joined_at < state.config.colo_detect_window_s / 2:
        return None
    for r in sorted(rs, key=lambda r: r.id):
        if r.slowdown_cap is not None and r.measured_slowdown is None:
            return r
    return None


def _history(
    r: RunningJob,
    rs: Sequence[RunningJob],
    pairs: Mapping[tuple[str, str], Observations],
) -> Observations | None:
    """The earlier episodes of ``r`` beside the one other job on its GPU (r's
    slowdown beside it); None with more partners, or unlabelled workloads."""
    others = [o for o in rs if o is not r]
    if len(others) != 1 or not r.workload or not others[0].workload:
        return None
    return pairs.get((r.workload, others[0].workload))


def _partner(
    later: RunningJob, concerned: RunningJob, rs: Sequence[RunningJob]
) -> RunningJob:
    """The job an eviction of ``later`` names as its partner: the job the
    eviction is for (``concerned``), or, when that is ``later`` itself, the
    first other job on the GPU."""
    if concerned.id != later.id:
        return concerned
    return next(r for r in rs if r is not later)


def _over_cap_evict(
    later: RunningJob,
    over: Sequence[RunningJob],
    rs: Sequence[RunningJob],
    judged: Mapping[int, Judged | None],
) -> Evict:
    """The eviction of ``later`` for the jobs of its GPU judged over their caps
    (``over``): named for the one furthest over; harmful when a judged slowdown
    is over the cap itself."""

    def judged_slowdown(r: RunningJob) -> float:
        j = judged[r.id]
        return j.slowdown if j is not None else 0.0

    hurt = max(
        over,
        key=lambda r: (
            judged_slowdown(r) / (r.slowdown_cap or 1.0),
            r.id != later.id,
        ),
    )
    partner = _partner(later, hurt, rs)
    assert hurt.measured_slowdown is not None
    who = "it" if hurt.id == later.id else f"job {hurt.id}"
    # judged over a cap: the pair is refused from now on; only too close to
    # it: its measured episode decides whether it is admitted later
    harmful = any(
        r.slowdown_cap is not None and judged_slowdown(r) > r.slowdown_cap for r in over
    )
    hurt_judged = judged[hurt.id]
    assert hurt_judged is not None
    record = (
        f" (with its pair's {hurt_judged.episodes} earlier"
        f" episode{'s' if hurt_judged.episodes != 1 else ''}:"
        f" {hurt_judged.slowdown:.2f}x)"
        if hurt_judged.episodes
        else ""
    )
    where = "over its cap of" if harmful else "too close to its cap of"
    then = (
        "this pair is not admitted again"
        if harmful
        else "this pair is admitted again only as a known pair within the caps"
    )
    return Evict(
        later.id,
        partner.id,
        f"sharing a GPU with job {partner.id}: {who} ran"
        f" {hurt.measured_slowdown:.2f}x slower than alone for"
        f" {hurt.measured_for_s / 60:.0f} min{record}, {where}"
        f" {hurt.slowdown_cap:g}x; sent back to the queue, and {then}",
        (later.workload, partner.workload),
        harmful=harmful,
    )


def evictions(state: ClusterState) -> list[Evict]:
    """The later job of each shared GPU on which a job was measured over its cap,
    less the admission's margin, for half of ``colo_detect_window_s`` or more
    (the pair is marked harmful only when measured over the cap itself), or,
    when the later job was
    admitted as an exploration trial, as soon as a job is measured clearly over
    its cap (``_over_cap``), or when a job of the trial could not be measured
    by half the window (``_unmeasured``); if its owner allows it to be requeued (an
    interactive job is never evicted: when it is the later job, its earliest
    batch partner goes instead). The reports start a minute or two into the
    episode and the next pass comes within a minute, so the job is stopped
    within the window, and a failing trial within a few minutes."""
    by_gpu: dict[int, list[RunningJob]] = {}
    for r in state.running:
        if len(r.gpu_ids) == 1 and r.shareable and not r.stopping:
            by_gpu.setdefault(r.gpu_ids[0], []).append(r)
    pairs = state.knowledge.pairs
    shared = any(len(rs) > 1 for rs in by_gpu.values())
    noise = (
        noise_for(state.knowledge)
        if shared and state.config.colo_evict_z is not None
        else None
    )
    out: list[Evict] = []
    for rs in by_gpu.values():
        if len(rs) < 2:
            continue
        joined = [r for r in rs if r.joined_at is not None]
        if not joined:
            continue
        later = max(joined, key=lambda r: (r.joined_at or 0.0, r.id))
        judged = {
            r.id: _judged(
                r,
                None if later.trial else _history(r, rs, pairs),
                noise,
                state.config,
            )
            for r in rs
        }
        over = [
            r for r in rs if _over_cap(r, judged[r.id], state.config, trial=later.trial)
        ]
        blind = None if over else _unmeasured(rs, later, state)
        if not over and blind is None:
            continue
        if is_interactive(state, later):
            # an interactive job is never evicted: its batch partner goes
            batch = [r for r in rs if not is_interactive(state, r)]
            if not batch:
                continue
            later = min(batch, key=lambda r: (r.joined_at or 0.0, r.id))
        if not later.evictable:
            continue
        if blind is not None:
            partner = _partner(later, blind, rs)
            who = "its" if blind.id == later.id else f"job {blind.id}'s"
            out.append(
                Evict(
                    later.id,
                    partner.id,
                    f"sharing a GPU with job {partner.id} as an exploration trial:"
                    f" {who} slowdown could not be measured in"
                    f" {state.config.colo_detect_window_s / 120:.0f} min (its"
                    " workload has no speed alone on record yet, or it reports no"
                    " progress), so its cap could not be watched; sent back to the"
                    " queue, and the pair may be tried again",
                    (later.workload, partner.workload),
                    harmful=False,
                )
            )
            continue
        out.append(_over_cap_evict(later, over, rs, judged))
    return out
