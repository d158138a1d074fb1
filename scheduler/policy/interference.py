"""The interference model: predicted slowdowns r_AB for two jobs sharing one GPU.

r_AB is A's slowdown when it shares a GPU with B: its time shared over its time
alone (>= 1). The model predicts log r_AB (slowdowns multiply, and measurement
noise is multiplicative) by shrinking three levels of knowledge into one another,
each level's mean weighted by how much evidence it has:

1. structure (no evidence needed): kernels of two processes are time-sliced, so A
   is slowed while B keeps the GPU busy. With u the fraction of its solo time a job
   keeps the GPU busy (its solo SM activity, measured by the agents; ``DEFAULT_BUSY``
   when never measured) and m its size (declared GPU memory), the prior is
   r_AB = 1 + u_A * u_B * 2 m_B / (m_A + m_B): the smaller job suffers more (seed
   finding 4), a job that mostly waits on its input barely notices a partner.
   Plus ``offset``: the mean residual log slowdown over every pair observed on this
   GPU model (contention on copies and caches the busy fractions cannot see, seed
   finding 5), which is what makes the prior learn too; plus each workload's own
   effects on what is left, learned from every pair it was observed in, whoever
   the partner: how much A suffers beside anyone (``sens``) and how much B slows
   anyone (``press``), log r_AB ~ structure + offset + sens[A] + press[B], each
   shrunk to 0 as if ``EFFECT_STRENGTH`` observations had shown none. A workload
   that starves every partner of memory bandwidth is expected to starve a new one
   too, before that pair or its families were ever tried;
2. family pair: what was observed for the same model families (``parse_label``:
   "ResNet-50 (batch size 64)" is family "resnet-50"), counted at ``FAMILY_WEIGHT``
   per observation (at most ``FAMILY_CAP`` in all): a ResNet-50 at batch 32 tells
   something about one at batch 64;
3. the exact workload pair (label and batch size): its weak evidence first (slowdowns
   read from per-process NVML utilisation, for episodes where a job reported no
   progress: its solo busy fraction over its busy fraction while shared, since
   time-sliced kernels spread the same work over a longer wall time), counted at
   ``WEAK_WEIGHT`` per episode (at most ``WEAK_CAP`` in all), then its observations
   (measured progress), counted fully. Once the episode noise is known, the levels
   above weigh against a pair's own record no more than the noise allows
   (``Model._record_prior``, empirical Bayes): pairs stray from what their family
   predicts by far more than one episode's measurement strays from its pair.

``confidence`` = n / (n + 1), n the exact pair's observations plus its weak
evidence's weight: 0 for a pair never seen together (family evidence moves the
estimate, not the confidence), 0.5 after one observation (or after four episodes
seen only through utilisation). The admission rule treats a pair below its confidence threshold
(default 0.5) as unknown: it may only be tried as an exploration trial within the
budget (``colocate``).

One observation is one sharing episode's measured slowdown: the job's progress rate
while it shared over its workload's solo rate (the agents' progress reports), the
loader's job in production and the simulator's. Pure: no Django, no I/O.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

DEFAULT_BUSY = 0.8  # solo GPU busy fraction assumed for a never-measured workload
# What the prior is worth, in observations of the exact pair. One observation is a
# whole sharing episode's mean over a report a minute (5 % noise per report), so
# it outweighs a prior that cannot tell a 1.1x pair from a 3x one.
PRIOR_STRENGTH = 0.25
FAMILY_WEIGHT = 0.25  # an observation of the family pair, in exact observations
FAMILY_CAP = 1.0  # the family's whole weight at most
# Per-process utilisation is a weak signal (seed finding 5: the contention is on
# copies, which SM activity shows only indirectly), so an episode seen only through
# it counts a quarter of an observation, and never more than one in all.
WEAK_WEIGHT = 0.25
WEAK_CAP = 1.0
# The offset (the residual every pair shares) is one number for the whole cluster:
# it is shrunk to 0 as if this many pairs had shown none, so that the first pair
# seen, good or bad, does not decide for all the others.
OFFSET_STRENGTH = 10.0
# The workloads' additive effects are shrunk to 0 as if this many observations had
# shown none: a workload seen in one pair moves its new pairs by a third of what
# was seen, one seen in eight pairs by four fifths.
EFFECT_STRENGTH = 2.0
EFFECT_ITERATIONS = 10  # alternating least squares: the effects settle in a few
# Pairs whose means' spread about the prior side (tau) must be in before a pair's
# record is weighed against the prior side by the noise (``Model._record_prior``).
RECORD_MIN_PAIRS = 10
MAX_LOG_R = math.log(64.0)  # clamp: a measured slowdown beyond 64x is an outlier

_BATCH = re.compile(r"(?:batch[\s_-]*size|bs)[\s=:_-]*(\d+)", re.IGNORECASE)
_PAREN = re.compile(r"\([^)]*\)")


@lru_cache(maxsize=4096)
def parse_label(label: str) -> tuple[str, int | None]:
    """(family, batch size) of a workload label: "ResNet-50 (batch size 64)" ->
    ("resnet-50", 64); "bert-base bs=32" -> ("bert-base", 32); "" -> ("", None).
    The family is the label without the batch size, lower-cased, spaces squeezed."""
    m = _BATCH.search(label)
    batch = int(m.group(1)) if m else None
    rest = _BATCH.sub(" ", label)
    rest = _PAREN.sub(" ", rest) if batch is not None else rest
    family = " ".join(rest.replace("_", " ").split()).strip(" -=:,").lower()
    return family, batch


def clamp_log(log_r: float) -> float:
    """A log slowdown as the model counts it: no faster than alone (0), no
    slower than ``MAX_LOG_R`` (an outlier)."""
    return min(max(log_r, 0.0), MAX_LOG_R)


@dataclass(frozen=True)
class Observations:
    """Log slowdowns observed for one ordered pair (A's slowdown beside B):
    count, mean and sum of squared deviations (Welford), so they merge cheaply."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, log_r: float) -> Observations:
        x = clamp_log(log_r)
        n = self.n + 1
        delta = x - self.mean
        mean = self.mean + delta / n
        return Observations(n, mean, self.m2 + delta * (x - mean))

    @classmethod
    def of(cls, log_rs: Iterable[float]) -> Observations:
        obs = cls()
        for x in log_rs:
            obs = obs.add(x)
        return obs

    @property
    def slowdown(self) -> float:
        return math.exp(self.mean)


# Episodes whose spread an episode's noise is pooled from: fewer, and the noise is
# not known well enough to weigh one measurement against the history.
NOISE_MIN_DF = 10
# An episode's noise is never taken as less than this (1 % in log): pairs whose
# episodes all read alike (rounded or replayed reports) must not make one
# measurement worth nothing beside them.
NOISE_FLOOR = 0.01


def episode_noise(pairs: Mapping[tuple[str, str], Observations]) -> float | None:
    """The standard deviation of one sharing episode's measured log slowdown about
    its pair's mean, pooled over every ordered pair observed more than once
    (sum of squared deviations over degrees of freedom): what one episode's
    measurement is worth beside a pair's history. It holds the progress reports'
    noise, the solo rate's and how a pair varies from one episode to the next.
    None while fewer than ``NOISE_MIN_DF`` degrees of freedom are in; at least
    ``NOISE_FLOOR``."""
    m2 = 0.0
    df = 0
    for obs in pairs.values():
        if obs.n > 1:
            m2 += obs.m2
            df += obs.n - 1
    if df < NOISE_MIN_DF:
        return None
    return max(NOISE_FLOOR, math.sqrt(max(m2, 0.0) / df))


@dataclass(frozen=True)
class Profile:
    """What the portal knows of a job before it shares: its label, declared GPU
    memory and its workload's solo busy fraction (None: never measured)."""

    workload: str = ""
    memory_mib: int | None = None
    busy: float | None = None


@dataclass(frozen=True)
class Estimate:
    """A predicted ordered-pair slowdown r_AB with its confidence in [0, 1] and
    where it came from ("pair", "utilisation", "family", "workloads" or "prior":
    the strongest level that had evidence)."""

    slowdown: float
    confidence: float
    source: str
    observations: int = 0


@dataclass(frozen=True)
class Knowledge:
    """Everything learned so far, as plain data (loaded by the pass from the
    database, kept by the simulator from its own measurements).

    ``pairs``: observations per ordered workload pair (A's label, B's label);
    ``busy``: solo busy fraction per workload label, from the agents' samples of
    jobs that ran alone; ``weak``: what utilisation showed of pairs whose jobs
    reported no progress; ``harmful``: pairs the pass evicted a job for."""

    pairs: Mapping[tuple[str, str], Observations] = field(
        default_factory=lambda: MappingProxyType({})
    )
    busy: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # the weak evidence per ordered pair: log slowdowns read from utilisation
    weak: Mapping[tuple[str, str], Observations] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # unordered workload pairs a job was evicted for (measured over a cap): never
    # admitted again until an admin resets the pair
    harmful: frozenset[frozenset[str]] = frozenset()


class _PriorSide(NamedTuple):
    """Everything the model knows of r_AB but the exact pair's own record."""

    mean: float  # log slowdown
    weight: float  # in exact observations
    source: str
    weak_weight: float  # the utilisation evidence's share of ``weight``
    exact: Observations | None  # the exact pair's record, if it has one


class Model:
    """Predicts r_AB from ``Knowledge``; built once per pass (the family pools and
    the offset are aggregated here, not per query)."""

    def __init__(self, knowledge: Knowledge) -> None:
        self.knowledge = knowledge
        families: dict[tuple[str, str], list[Observations]] = {}
        # (A, B, observed mean log slowdown less the structure, observations)
        residuals: list[tuple[str, str, float, int]] = []
        for (a, b), obs in knowledge.pairs.items():
            if obs.n <= 0:
                continue
            fa, fb = parse_label(a)[0], parse_label(b)[0]
            families.setdefault((fa, fb), []).append(obs)
            base = self._structural(
                Profile(a, None, knowledge.busy.get(a)),
                Profile(b, None, knowledge.busy.get(b)),
            )
            residuals.append((a, b, obs.mean - base, obs.n))
        residual_sum = sum(x * n for _, _, x, n in residuals)
        residual_n = sum(n for _, _, _, n in residuals)
        self.family: dict[tuple[str, str], tuple[float, float]] = {
            k: (
                sum(o.n for o in v),
                sum(o.mean * o.n for o in v) / sum(o.n for o in v),
            )
            for k, v in families.items()
        }
        # the residual every pair shares (copy and cache contention), shrunk to 0
        # while few pairs were seen
        self.offset = residual_sum / (residual_n + OFFSET_STRENGTH)
        self.sens, self.press = self._effects(
            [(a, b, x - self.offset, n) for a, b, x, n in residuals if a and b]
        )
        self._cache: dict[tuple[Profile, Profile], Estimate] = {}
        self.noise = noise_for(knowledge)
        self.record_prior = self._record_prior()

    @staticmethod
    def _effects(
        rows: list[tuple[str, str, float, int]],
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Each workload's additive effects on the residual log slowdown,
        ``rows`` (A, B, log r_AB - structure - offset, observations) ~ sens[A] +
        press[B]: ridge regression (each effect shrunk to 0 by ``EFFECT_STRENGTH``
        observations), each pair weighted by its observations, solved by
        alternating least squares (a few sweeps over a few hundred pairs a pass
        at most)."""
        sens: dict[str, float] = {}
        press: dict[str, float] = {}
        for _ in range(EFFECT_ITERATIONS if rows else 0):
            num: dict[str, float] = {}
            den: dict[str, float] = {}
            for a, b, x, n in rows:
                num[a] = num.get(a, 0.0) + n * (x - press.get(b, 0.0))
                den[a] = den.get(a, 0.0) + n
            sens = {k: v / (den[k] + EFFECT_STRENGTH) for k, v in num.items()}
            num, den = {}, {}
            for a, b, x, n in rows:
                num[b] = num.get(b, 0.0) + n * (x - sens.get(a, 0.0))
                den[b] = den.get(b, 0.0) + n
            press = {k: v / (den[k] + EFFECT_STRENGTH) for k, v in num.items()}
        return sens, press

    def harmful(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self.knowledge.harmful

    def _busy(self, p: Profile) -> float:
        if p.busy is not None:
            return min(max(p.busy, 0.0), 1.0)
        return self.knowledge.busy.get(p.workload, DEFAULT_BUSY)

    def _structural(self, a: Profile, b: Profile) -> float:
        """log r_AB from the time-slicing model alone (no offset)."""
        ua = a.busy if a.busy is not None else DEFAULT_BUSY
        ub = b.busy if b.busy is not None else DEFAULT_BUSY
        ma, mb = a.memory_mib, b.memory_mib
        size = 2.0 * mb / (ma + mb) if ma and mb else 1.0
        return math.log1p(ua * ub * size)

    def _prior_side(self, a: Profile, b: Profile) -> _PriorSide:
        """Everything the model knows of r_AB but the exact pair's own record."""
        pa = Profile(a.workload, a.memory_mib, self._busy(a))
        pb = Profile(b.workload, b.memory_mib, self._busy(b))
        mean = self._structural(pa, pb) + self.offset
        source = "prior"
        if a.workload in self.sens or b.workload in self.press:
            mean += self.sens.get(a.workload, 0.0) + self.press.get(b.workload, 0.0)
            source = "workloads"
        weight = PRIOR_STRENGTH
        fam = self.family.get((parse_label(a.workload)[0], parse_label(b.workload)[0]))
        exact = self.knowledge.pairs.get((a.workload, b.workload))
        if exact is not None and (exact.n <= 0 or not a.workload or not b.workload):
            exact = None
        n_exact = exact.n if exact is not None else 0
        if fam is not None and a.workload and b.workload:
            # the family pool includes the exact pair: count only the others
            n_fam, fam_mean = fam
            n_other = n_fam - n_exact
            if n_other > 0:
                other_mean = (
                    (fam_mean * n_fam - exact.mean * n_exact) / n_other
                    if exact is not None
                    else fam_mean
                )
                w = min(FAMILY_CAP, FAMILY_WEIGHT * n_other)
                mean = (mean * weight + other_mean * w) / (weight + w)
                weight += w
                source = "family"
        weak = self.knowledge.weak.get((a.workload, b.workload))
        w_weak = 0.0
        if weak is not None and weak.n > 0 and a.workload and b.workload:
            w_weak = min(WEAK_CAP, WEAK_WEIGHT * weak.n)
            mean = (mean * weight + weak.mean * w_weak) / (weight + w_weak)
            weight += w_weak
            source = "utilisation"
        return _PriorSide(mean, weight, source, w_weak, exact)

    def _record_prior(self) -> float | None:
        """What the prior side is worth beside a pair's own record, in episodes
        of that pair (empirical Bayes): the episode noise squared
        (``episode_noise``) over how far observed pairs' means stray from what
        the prior side predicted for them, the noise of those means taken out
        (tau^2). Pairs of one family differ by batch size (in Gavel's P100 table
        A3C beside Transformer 16 runs 1.43x while its family and workload
        effects say 1.6x), so a pair seen three times must be judged by what it
        did, not a third of the way back to its family. None while the noise or
        fewer than ``RECORD_MIN_PAIRS`` observed pairs are known: the fixed
        weights alone."""
        if self.noise is None:
            return None
        sq = 0.0  # squared distances of the pairs' means from the prior side
        inv_n = 0.0  # 1 / n per pair: each mean's own noise is noise^2 / n
        pairs = 0
        for (a, b), obs in self.knowledge.pairs.items():
            if obs.n <= 0 or not a or not b:
                continue
            sq += (obs.mean - self._prior_side(Profile(a), Profile(b)).mean) ** 2
            inv_n += 1.0 / obs.n
            pairs += 1
        if pairs < RECORD_MIN_PAIRS:
            return None
        tau2 = (sq - self.noise**2 * inv_n) / pairs
        if tau2 <= 0.0:
            return None
        return self.noise**2 / tau2

    def estimate(self, a: Profile, b: Profile) -> Estimate:
        """r_AB: A's predicted slowdown beside B."""
        key = (a, b)
        got = self._cache.get(key)
        if got is not None:
            return got
        mean, weight, source, w_weak, exact = self._prior_side(a, b)
        n_exact = exact.n if exact is not None else 0
        if exact is not None:
            if self.record_prior is not None:
                weight = min(weight, self.record_prior)
            mean = (mean * weight + exact.mean * n_exact) / (weight + n_exact)
            source = "pair"
        evidence = n_exact + w_weak
        got = Estimate(
            slowdown=math.exp(max(mean, 0.0)),
            confidence=evidence / (evidence + 1.0),
            source=source,
            observations=n_exact,
        )
        self._cache[key] = got
        return got


# What a family pair's odds are shrunk to its relation's (pairs of one family, or
# of two) with: as if this many of its pairs had shown the relation's rate.
ODDS_STRENGTH = 2.0


@dataclass(frozen=True)
class Odds:
    """How likely a never-tried pair is to be admissible once observed: ``p``,
    from ``wins`` of the ``tried`` pairs of its two families (shrunk to the tried
    pairs of its relation: one family, or two)."""

    p: float
    wins: int
    tried: int
    families: tuple[str, str]


class Outcomes:
    """What became of the workload pairs tried so far: per unordered pair, its
    combined normalised throughput and worst slowdown as observed (both
    directions needed), or a failure when it was marked harmful (evicted over a
    cap, or out of memory where that is recorded). Built once per ``Knowledge``;
    ``with_live`` adds the verdicts of trials still running.

    A trial is worth its cost only if the pair may turn out admissible. Pairs of
    the same families behave alike (in Gavel's measured table, 14 of the 15 LM
    pairs on P100 lose throughput), and pairs of one family lose more often than
    pairs of two (docs/policy.md): so the odds of a new pair are the share of
    admissible pairs among those tried of its two families, shrunk
    (``ODDS_STRENGTH`` pairs' worth) to the share among tried pairs of its
    relation, one family or two, itself (wins + 1) / (tried + 2): 1/2 with none
    tried. Where no pair shares well (K80) the odds fall as 1 / (tried + 2) and
    exploration stops; where some do, it goes on among families not yet seen to
    fail."""

    def __init__(self, knowledge: Knowledge) -> None:
        pairs = knowledge.pairs
        # (families sorted, one family?, a workload with itself?, gain, worst
        # slowdown)
        self.tried: list[tuple[tuple[str, str], bool, bool, float, float]] = []
        self.seen: set[frozenset[str]] = set(knowledge.harmful)
        for key in knowledge.harmful:
            a, b = (*key, *key)[:2]
            if a and b:
                self._add(a, b, 0.0, math.inf)
        for (a, b), ab in pairs.items():
            key = frozenset((a, b))
            if key in self.seen or not a or not b:
                continue
            ba = pairs.get((b, a))
            if ab.n <= 0 or ba is None or ba.n <= 0:
                continue
            self.seen.add(key)
            r_ab, r_ba = ab.slowdown, ba.slowdown
            self._add(a, b, gain(r_ab, r_ba), max(r_ab, r_ba))
        self._cache: dict[tuple[object, ...], Odds] = {}

    def _add(self, a: str, b: str, g: float, worst: float) -> None:
        fa, fb = sorted((parse_label(a)[0], parse_label(b)[0]))
        self.tried.append(((fa, fb), fa == fb, a == b, g, worst))

    def with_live(self, live: Mapping[frozenset[str], tuple[float, float]]) -> Outcomes:
        """These outcomes and those of trials still running (unordered pair ->
        (gain, worst slowdown) as measured so far, ``colocate.live_trials``),
        for pairs nothing else is known of. A failing trial is evicted within
        minutes and becomes harmful, while a good one runs for hours before its
        episode is observed: without its running verdict the odds would count
        every failure at once and every success hours later."""
        extra = [
            (key, v) for key, v in live.items() if key not in self.seen and all(key)
        ]
        if not extra:
            return self
        got = copy.copy(self)
        got.tried = list(self.tried)
        got.seen = set(self.seen)
        got._cache = {}
        for key, (g, worst) in extra:
            a, b = (*key, *key)[:2]
            got.seen.add(key)
            got._add(a, b, g, worst)
        return got

    def odds(
        self,
        a: str,
        b: str,
        *,
        cap: float | None,
        need_gain: float,
        cap_margin: float,
        itself: bool = False,
    ) -> Odds:
        """The odds that the pair (``a``, ``b``) is admissible: its gain over
        ``need_gain`` and its worst slowdown, ``cap_margin`` added, within
        ``cap`` (None: unbounded). ``itself``: a workload with itself (same
        label, batch size included) is a relation of its own, apart from the
        other pairs of its family: in Gavel's P100 table 2 of 26 such pairs are
        admissible, 0 of the 46 pairs of one family at two batch sizes."""
        fa, fb = sorted((parse_label(a)[0], parse_label(b)[0]))
        ident = itself and a == b
        key = (fa, fb, ident, itself, cap, need_gain, cap_margin)
        got = self._cache.get(key)
        if got is not None:
            return got
        same = fa == fb
        counts = {"relation": [0, 0], "families": [0, 0]}
        for fams, rel, idn, g, worst in self.tried:
            if rel != same or (itself and idn != ident):
                continue
            win = g > need_gain and (cap is None or worst * (1.0 + cap_margin) <= cap)
            levels = ("relation", "families") if fams == (fa, fb) else ("relation",)
            for level in levels:
                counts[level][0] += win
                counts[level][1] += 1
        w, n = counts["relation"]
        p = (w + 1.0) / (n + 2.0)
        w, n = counts["families"]
        p = (w + ODDS_STRENGTH * p) / (n + ODDS_STRENGTH)
        got = self._cache[key] = Odds(p, w, n, (fa, fb))
        return got


_last: list[tuple[Knowledge, Model]] = []
_last_outcomes: list[tuple[Knowledge, Outcomes]] = []
_last_noise: list[tuple[Knowledge, float | None]] = []


def noise_for(knowledge: Knowledge) -> float | None:
    """``episode_noise`` of ``knowledge``'s pairs, kept while passes bring the same
    (frozen) object: one pass reads it for its evictions, its model and its
    re-trials."""
    if _last_noise and _last_noise[0][0] is knowledge:
        return _last_noise[0][1]
    got = episode_noise(knowledge.pairs)
    _last_noise[:] = [(knowledge, got)]
    return got


def outcomes_for(knowledge: Knowledge) -> Outcomes:
    """The ``Outcomes`` of ``knowledge``, kept while passes bring the same
    (frozen) object, as ``model_for`` keeps its ``Model``."""
    if _last_outcomes and _last_outcomes[0][0] is knowledge:
        return _last_outcomes[0][1]
    got = Outcomes(knowledge)
    _last_outcomes[:] = [(knowledge, got)]
    return got


def model_for(knowledge: Knowledge) -> Model:
    """The ``Model`` of ``knowledge``, kept while the next pass brings the same
    (frozen) ``Knowledge`` object: the simulator's passes mostly do, and building
    the family pools and offset is the model's whole cost."""
    if _last and _last[0][0] is knowledge:
        return _last[0][1]
    model = Model(knowledge)
    _last[:] = [(knowledge, model)]
    return model


def gain(r_ab: float, r_ba: float) -> float:
    """Combined normalised throughput of a pair: 1/r_AB + 1/r_BA. Sharing beats
    taking turns exactly when it is above 1, i.e. r_AB * r_BA < r_AB + r_BA (P2)."""
    return 1.0 / r_ab + 1.0 / r_ba
