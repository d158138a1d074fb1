"""Co-location in the simulator: the ground-truth table and the measurement model.

Ground truth (``--colocation FILE``, Gavel's ``colocation_pairs.csv``): for each
unordered pair of single-GPU workloads on a GPU model (``worker_type``, matched
case-insensitively), each job's normalised throughput beside the other,
norm_a = colocated_a / isolated_a, and whether the pair fits in memory at all
(``feasible``; a pair the table lacks counts as infeasible). The policy never reads
this table; only the physics (``engine``) and the simulator-only ``oracle`` do.

What the policy sees instead is what the agents would report in production: one
progress report per job per minute, lognormal around the job's true rate
(log report ~ N(log rate, ``NOISE_SIGMA``^2)). Rates are kept normalised (1 = the
workload alone on that GPU model), which is the same thing as steps/s divided by a
constant per (workload, model).

The analytic shortcut. Generating one event per report would cost one heap push per
job per simulated minute. Instead a ``Segment`` (a stretch of one attempt at one
constant rate: alone, or beside the same partners) draws the reports it owes only
when someone needs them (a pass, or the end of the segment): ``k`` reports at rate r
have log-sum ~ N(k log r, k sigma^2), the sum of k independent N(log r, sigma^2)
draws, so drawing the sum in one go (or in several instalments of k1, k2, ... that
add up to k) has exactly the distribution of the k reports' logs summed one by one.
The measured rate over a segment is the geometric mean of its reports, exp(log-sum
/ k), whose log is N(log r, sigma^2 / k). A segment of length L yields floor(L / 60)
reports (the report straddling a rate change is dropped, as a job's progress report
over a minute in which its partner left would be by a careful loader).

A workload's solo rate (per GPU model) is pooled from every report of its jobs while
they ran alone; a job's measured slowdown in its current sharing episode is that
solo rate over its measured shared rate (None until 2 reports of each are in). When
a sharing episode with one partner ends after at least ``MIN_EPISODE_S`` of reports,
its measured log slowdown becomes one observation of the ordered pair (the job's
workload, its partner's) in ``Knowledge.pairs`` (if its workload's solo rate is
not known yet, the episode waits for it: the observation is made once it is). A pair whose later job was evicted
goes to ``Knowledge.harmful`` (never admitted again), as the production writer will;
so does a pair whose joiner failed out of memory (the simulator's choice).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from scheduler.policy.interference import Knowledge, Observations
from scheduler.sim.trace import TraceError, _open_rows, _opt, _require

if TYPE_CHECKING:
    from collections.abc import Iterable

REPORT_S = 60.0  # one progress report per job per simulated minute
NOISE_SIGMA = 0.05  # lognormal sigma of one report
MIN_REPORTS = 2  # a measured rate needs this many reports
MIN_EPISODE_S = 300.0  # a sharing episode shorter than this teaches nothing

COLOCATION_COLUMNS = (
    "worker_type",
    "job_a",
    "scale_factor_a",
    "job_b",
    "scale_factor_b",
    "isolated_a",
    "isolated_b",
    "colocated_a",
    "colocated_b",
    "feasible",
)


class ColocationTable:
    """A's normalised throughput beside B on one GPU model, single-GPU jobs only;
    ``None`` for a pair that does not fit in memory (or that the table lacks)."""

    def __init__(self, pairs: dict[tuple[str, str, str], float | None]) -> None:
        self.pairs = pairs
        self._workloads: dict[str, set[str]] = {}
        for model, a, _b in pairs:
            self._workloads.setdefault(model, set()).add(a)

    def norm(self, model: str, a: str, b: str) -> float | None:
        """A's throughput beside B over A's alone; None: out of memory."""
        return self.pairs.get((model.lower(), a, b))

    def combined(self, model: str, a: str, b: str) -> float:
        """1/r_AB + 1/r_BA = norm_a + norm_b; 0 for a pair that does not fit."""
        na, nb = self.norm(model, a, b), self.norm(model, b, a)
        return 0.0 if na is None or nb is None else na + nb

    def workloads(self, models: Iterable[str]) -> frozenset[str]:
        """Workloads with at least one row on any of ``models``."""
        out: set[str] = set()
        for m in models:
            out |= self._workloads.get(m.lower(), set())
        return frozenset(out)

    def models(self) -> frozenset[str]:
        return frozenset(self._workloads)


def read_colocation(path: str) -> ColocationTable:
    """Gavel's ``colocation_pairs.csv`` (one row per unordered pair per
    worker_type); rows of jobs on more than one GPU are left out (multi-GPU jobs
    never share). norm = colocated / isolated from the unrounded columns."""
    header, rows = _open_rows(path)
    _require(path, header, COLOCATION_COLUMNS, "co-location")
    pairs: dict[tuple[str, str, str], float | None] = {}
    for line, row in rows:
        if _opt(row, "scale_factor_a") != "1" or _opt(row, "scale_factor_b") != "1":
            continue
        model = _opt(row, "worker_type").lower()
        a, b = _opt(row, "job_a"), _opt(row, "job_b")
        if not model or not a or not b:
            raise TraceError(f"{path}:{line}: worker_type, job_a and job_b must be set")
        feasible = _opt(row, "feasible")
        if feasible not in ("0", "1"):
            raise TraceError(f"{path}:{line}: column 'feasible' must be 0 or 1")
        values = []
        for col in ("isolated_a", "isolated_b", "colocated_a", "colocated_b"):
            text = _opt(row, col)
            try:
                v = float(text) if text else 0.0
            except ValueError:
                raise TraceError(
                    f"{path}:{line}: column {col!r} is not a number: {text!r}"
                ) from None
            if not math.isfinite(v) or v < 0:
                raise TraceError(f"{path}:{line}: column {col!r} is not >= 0: {text!r}")
            values.append(v)
        iso_a, iso_b, co_a, co_b = values
        if feasible == "1" and min(values) > 0:
            pairs[(model, a, b)] = co_a / iso_a
            pairs[(model, b, a)] = co_b / iso_b
        else:
            pairs[(model, a, b)] = None
            pairs[(model, b, a)] = None
    return ColocationTable(pairs)


@dataclass
class Segment:
    """A stretch of one attempt at one constant rate: alone (no partners) or beside
    the same partners; ``n`` reports drawn so far, the sum of their logs."""

    start: float
    rate: float
    partners: tuple[int, ...] = ()
    n: int = 0
    sum_log: float = 0.0
    # a sharing episode that an exploration trial began (its latest joiner was
    # admitted as a trial), and the GPU's true combined normalised throughput
    trial: bool = False
    combined: float = 1.0

    @property
    def measured_s(self) -> float:
        return self.n * REPORT_S


@dataclass
class Meter:
    """Noisy progress reports, drawn lazily (see the module docstring), and what
    is learned from them: solo rates per (workload, model) and pair observations."""

    seed: int = 0
    sigma: float = NOISE_SIGMA
    rng: random.Random = field(init=False)
    # (workload, model) -> [reports, sum of their logs] while running alone
    solo: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    pairs: dict[tuple[str, str], Observations] = field(default_factory=dict)
    harmful: set[frozenset[str]] = field(default_factory=set)
    observed: int = 0  # observations made
    # episodes ended before their workload's solo rate was known: solo key ->
    # (partner's workload, mean log rate while sharing)
    waiting: dict[tuple[str, str], list[tuple[str, float]]] = field(
        default_factory=dict
    )
    version: int = 0  # bumped when ``pairs`` or ``harmful`` change
    _knowledge: Knowledge = field(default_factory=Knowledge)
    _knowledge_version: int = -1

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}/progress")

    def advance(self, seg: Segment, now: float, solo_key: tuple[str, str]) -> None:
        """Draw the reports ``seg`` owes up to ``now``; a solo segment's go to its
        workload's solo pool as they arrive."""
        due = int((now - seg.start) // REPORT_S)
        new = due - seg.n
        if new <= 0:
            return
        drawn = self.rng.gauss(new * math.log(seg.rate), self.sigma * math.sqrt(new))
        seg.n = due
        seg.sum_log += drawn
        if not seg.partners and solo_key[0]:
            pool = self.solo.setdefault(solo_key, [0.0, 0.0])
            pool[0] += new
            pool[1] += drawn
            if pool[0] >= MIN_REPORTS and solo_key in self.waiting:
                solo = pool[1] / pool[0]
                for partner, shared in self.waiting.pop(solo_key):
                    self.observe(solo_key[0], partner, solo - shared)

    def solo_log_rate(self, solo_key: tuple[str, str]) -> float | None:
        pool = self.solo.get(solo_key)
        if pool is None or pool[0] < MIN_REPORTS:
            return None
        return pool[1] / pool[0]

    def log_slowdown(self, seg: Segment, solo_key: tuple[str, str]) -> float | None:
        """log(measured solo rate / measured rate in ``seg``), None until both
        have ``MIN_REPORTS`` reports."""
        if not seg.partners or seg.n < MIN_REPORTS:
            return None
        solo = self.solo_log_rate(solo_key)
        if solo is None:
            return None
        return solo - seg.sum_log / seg.n

    def episode_ended(
        self, seg: Segment, solo_key: tuple[str, str], partner: str
    ) -> None:
        """A sharing episode with one partner ended (``seg`` has drawn its
        reports): one observation of (its workload, ``partner``), now or once the
        workload's solo rate is known."""
        if seg.measured_s < MIN_EPISODE_S or seg.n < MIN_REPORTS:
            return
        shared = seg.sum_log / seg.n
        solo = self.solo_log_rate(solo_key)
        if solo is None:
            self.waiting.setdefault(solo_key, []).append((partner, shared))
        else:
            self.observe(solo_key[0], partner, solo - shared)

    def observe(self, workload: str, partner: str, log_r: float) -> None:
        key = (workload, partner)
        self.pairs[key] = self.pairs.get(key, Observations()).add(log_r)
        self.observed += 1
        self.version += 1

    def refuse(self, workload: str, partner: str) -> None:
        """The pair hurt (an eviction) or could not fit (an OOM): never again."""
        pair = frozenset((workload, partner))
        if pair not in self.harmful:
            self.harmful.add(pair)
            self.version += 1

    def knowledge(self) -> Knowledge:
        """A frozen snapshot (rebuilt only when something changed)."""
        if self._knowledge_version != self.version:
            self._knowledge = Knowledge(
                pairs=MappingProxyType(dict(self.pairs)),
                harmful=frozenset(self.harmful),
            )
            self._knowledge_version = self.version
        return self._knowledge
