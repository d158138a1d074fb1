"""The simulator's progress model: which jobs print ``GPULAB_PROGRESS step/total``,
what they report over each attempt, the ``Progress`` the policy sees of them, and
how well a running job's end was predicted (and reservations kept).

An assumption of the simulator, not a measurement (``ASSUMPTION`` says it in the
result): a share of the jobs (``--progress-fraction``) reports progress, drawn per
job by the seed; each has a total known in steps (the trace's steps for a
workload job, else its reference duration over a drawn time per step); the step
rate varies along the run: the first 5 % of its work at half speed (warm-up),
no steps during the last 2 min of every 30 min of work (checkpoints,
evaluation), and each report's steps since the previous one times a lognormal
factor (``--progress-noise`` scales its sigma, 0.2). A share of the reporting
jobs (``--early-stop-fraction``) ends before its total, at 30-90 % of it (early
stopping, a converged search). Reports come once a minute from the attempt's
start; the rate is measured over the attempt, from its first report to its
latest, as ``Attempt.progress_rate`` does. The physics never change: a job runs
exactly as long as without the model; the model only decides what it reports.

Measurement (``summary``): at 25 %, 50 % and 75 % of each finished job's last
attempt, the end ``policy.remaining.expected_end`` would give from what the job
had reported by then; APE = |predicted end - actual end| / (actual end - attempt
start), its median per point for the reporting jobs, and for the others under the
policy's plan (its limit unless backfill plans with predictions) and under
min(limit, prediction). A reservation slips when its job starts more than
max(60 s, 10 % of the promised wait) after any start time shown to it while it
waited before its first start.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from scheduler.policy.remaining import Progress, expected_end

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from scheduler.policy import PolicyConfig
    from scheduler.sim.jobs import SimJob

REPORT_S = 60.0  # one report a minute from the attempt's start
WARMUP_SHARE = 0.05  # the first 5 % of the work ...
WARMUP_SPEED = 0.5  # ... at half speed
PAUSE_EVERY_S = 1800.0  # of work: a pause in each such stretch ...
PAUSE_S = 120.0  # ... its last 2 min, no steps
NOISE_SIGMA = 0.2  # lognormal sigma of each report's steps since the previous one
EARLY_STOP = (0.3, 0.9)  # an early-stopping job ends at this share of its total
STEP_S = (0.05, 2.0)  # seconds per step, log-uniform (jobs without trace steps)
POINTS = (25, 50, 75)  # per cent of the run where the predicted end is measured
SLIP_MIN_S = 60.0
SLIP_SHARE = 0.1

ASSUMPTION = (
    "progress: a drawn share of jobs (--progress-fraction) reports steps of a known"
    f" total once per {REPORT_S:g} s; the rate varies along the run (first"
    f" {WARMUP_SHARE:.0%} of the work at {WARMUP_SPEED:g}x, no steps in the last"
    f" {PAUSE_S:g} s of every {PAUSE_EVERY_S:g} s of work, each report's steps"
    f" times a lognormal factor, sigma {NOISE_SIGMA:g} x --progress-noise); a drawn"
    " share of them (--early-stop-fraction) ends at 30-90 % of its total; the"
    " physics (true run times) are unchanged"
)

_UNIT = NormalDist()
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash, so a report's noise depends only on
    (seed, job, attempt, report), never on the order it was drawn in."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _productive(w: float) -> float:
    """Seconds of work in [0, w] outside the pauses."""
    full, rest = divmod(w, PAUSE_EVERY_S)
    return full * (PAUSE_EVERY_S - PAUSE_S) + min(rest, PAUSE_EVERY_S - PAUSE_S)


@dataclass(frozen=True)
class ProgressModel:
    fraction: float = 0.5  # of the jobs, report progress
    early_stop_fraction: float = 0.2  # of the reporting jobs, end before the total
    noise: float = 1.0  # multiplies NOISE_SIGMA (2.0: the noise doubled)
    seed: int = 0


@dataclass
class _Attempt:
    number: int
    start: float
    work: float  # its solo-seconds of work (the job's true run alone)
    # (time, work done, rate from then): one entry per rate the attempt ran at
    times: list[float] = field(default_factory=list)
    works: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    reported: list[float] = field(default_factory=lambda: [0.0])  # step at report k
    true_steps: list[float] = field(default_factory=lambda: [0.0])
    last_k: int = -1
    view: Progress | None = None
    view_end: float | None = None  # the end ``view`` gave when it was built


@dataclass
class _Job:
    reports: bool
    total: float  # the total it reports
    stop: float  # the share of the total at which it truly ends (1: none)
    key: int
    attempt: _Attempt | None = None


class ProgressTracker:
    """What every job reports, attempt by attempt, and the measurements."""

    def __init__(
        self, jobs: Sequence[SimJob], model: ProgressModel, config: PolicyConfig
    ) -> None:
        self.model = model
        self.config = config
        self.reads = config.plans_with_progress  # the policy reads progress
        self.sigma = NOISE_SIGMA * model.noise
        # common random numbers: every job draws the same values whatever the
        # fractions, so a change of fraction changes only who reports
        rng = random.Random(f"progress:{model.seed}")
        self.jobs: dict[int, _Job] = {}
        for job in sorted(jobs, key=lambda j: j.id):
            u_report, u_early, u_stop, u_step = (rng.random() for _ in range(4))
            early = u_early < model.early_stop_fraction
            stop = EARLY_STOP[0] + u_stop * (EARLY_STOP[1] - EARLY_STOP[0])
            stop = stop if early else 1.0
            if job.steps is not None and job.steps > 0:
                steps = job.steps
            else:
                lo, hi = math.log(STEP_S[0]), math.log(STEP_S[1])
                steps = job.ref_duration / math.exp(lo + u_step * (hi - lo))
            total = max(10.0, math.floor(steps / stop))
            self.jobs[job.id] = _Job(
                u_report < model.fraction,
                total,
                stop,
                _mix(model.seed * 1_000_003 + job.id),
            )
        self.deadline: dict[int, float] = {}  # job -> slip deadline before start
        self.shown: set[int] = set()
        self.started_shown = 0  # jobs shown a start time that started
        self.slipped: set[int] = set()
        self.ape: dict[str, dict[int, list[float]]] = {
            k: {p: [] for p in POINTS}
            for k in ("progress", "no_progress_plan", "no_progress_prediction")
        }
        self.ape_early: dict[int, list[float]] = {p: [] for p in POINTS}

    # ------------------------------------------------------------------ physics hooks

    def started(self, job: SimJob, now: float) -> None:
        """A new attempt (its rate already set); a first start settles whether
        the reservations it was shown slipped."""
        if job.first_start == now and job.id in self.deadline:
            self.started_shown += 1
            if now > self.deadline[job.id]:
                self.slipped.add(job.id)
        j = self.jobs[job.id]
        if j.reports:
            j.attempt = _Attempt(job.attempt, now, job.run_duration)
            self._record(j.attempt, job)

    def observe(self, jobs: Iterable[SimJob]) -> None:
        """Record each reporting job's rate changes since the last look (called
        before and after every pass: rates change only at events and decisions)."""
        for job in jobs:
            a = self.jobs[job.id].attempt
            if a is not None and a.number == job.attempt:
                self._record(a, job)

    def _record(self, a: _Attempt, job: SimJob) -> None:
        t, rate = job.rate_since, job.rate
        if a.times and a.times[-1] == t:
            a.works[-1], a.rates[-1] = job.done_work, rate
        else:
            a.times.append(t)
            a.works.append(job.done_work)
            a.rates.append(rate)

    def shown_start(self, job: SimJob, now: float, est: float) -> None:
        """A start time shown to a job waiting for its first start."""
        if job.first_start is not None:
            return
        self.shown.add(job.id)
        limit = est + max(SLIP_MIN_S, SLIP_SHARE * max(0.0, est - now))
        if limit < self.deadline.get(job.id, math.inf):
            self.deadline[job.id] = limit

    # ------------------------------------------------------------------ reports

    def _work_at(self, a: _Attempt, t: float) -> float:
        i = bisect.bisect_right(a.times, t) - 1
        if i < 0:
            return 0.0
        return min(a.work, a.works[i] + a.rates[i] * (t - a.times[i]))

    def _true_step(self, j: _Job, a: _Attempt, w: float) -> float:
        """Steps done after ``w`` solo-seconds of work: the warm-up and pauses
        shape them, and the attempt's whole work makes ``stop`` of the total."""

        def s(x: float) -> float:
            return _productive(x) - (1.0 - WARMUP_SPEED) * _productive(
                min(x, WARMUP_SHARE * a.work)
            )

        whole = s(a.work)
        return j.total * j.stop * (s(w) / whole if whole > 0 else 0.0)

    def _reported(self, j: _Job, a: _Attempt, k: int) -> float:
        """The step reported at the attempt's k-th report (k >= 1): each report
        adds its true steps since the previous one times a lognormal factor
        (mean 1), so reports never go backwards."""
        steps = a.reported
        while len(steps) <= k:
            i = len(steps)
            true = self._true_step(j, a, self._work_at(a, a.start + i * REPORT_S))
            u = (_mix(j.key ^ (a.number << 40) ^ i) >> 11) / float(1 << 53)
            z = _UNIT.inv_cdf(min(max(u, 1e-12), 1.0 - 1e-12))
            factor = math.exp(self.sigma * z - self.sigma * self.sigma / 2.0)
            steps.append(steps[-1] + (true - a.true_steps[-1]) * factor)
            a.true_steps.append(true)
        return math.floor(steps[k])

    def _progress(self, j: _Job, a: _Attempt, t: float) -> Progress | None:
        """What the policy sees at ``t``: the latest report and the rate since the
        first, once there are two."""
        k = int((t - a.start) // REPORT_S)
        if k < 2:
            return None
        first, last = self._reported(j, a, 1), self._reported(j, a, k)
        return Progress(
            last, j.total, a.start + k * REPORT_S, (last - first) / ((k - 1) * REPORT_S)
        )

    def view(self, job: SimJob, now: float) -> Progress | None:
        """The ``RunningJob.progress`` of ``job`` now (None: it does not report,
        has reported less than twice, or the policy does not read progress)."""
        j = self.jobs[job.id]
        a = j.attempt
        if not self.reads or a is None or a.number != job.attempt:
            return None
        k = int((now - a.start) // REPORT_S)
        if k != a.last_k:
            a.last_k = k
            a.view = self._progress(j, a, now)
            a.view_end = a.view.end(now) if a.view is not None else None
        return a.view

    def moved(self, jobs: Iterable[SimJob], now: float) -> bool:
        """Whether some running job's reports moved its end since the policy last
        saw it, by more than max(60 s, 10 % of the time left to it), or gave or
        lost an end: then a periodic pass is not skipped (production runs one
        anyway; the replay skips those that nothing could change)."""
        if not self.reads:
            return False
        for job in jobs:
            j = self.jobs[job.id]
            a = j.attempt
            if a is None or a.number != job.attempt:
                continue
            k = int((now - a.start) // REPORT_S)
            if k == a.last_k:
                continue
            p = self._progress(j, a, now)
            end = p.end(now) if p is not None else None
            old = a.view_end
            if end is None or old is None:
                if (end is None) != (old is None):
                    return True
                continue
            if abs(end - old) > max(SLIP_MIN_S, SLIP_SHARE * max(0.0, old - now)):
                return True
        return False

    def due(self, jobs: Iterable[SimJob], now: float) -> set[int]:
        """The reporting jobs with a report since their view was built."""
        if not self.reads:
            return set()
        out = set()
        for job in jobs:
            a = self.jobs[job.id].attempt
            if (
                a is not None
                and a.number == job.attempt
                and int((now - a.start) // REPORT_S) != a.last_k
            ):
                out.add(job.id)
        return out

    # ------------------------------------------------------------------ measurement

    def ended(self, job: SimJob, now: float) -> None:
        """Measure the predicted end at 25/50/75 % of the job's last attempt."""
        start, run = job.started_at, now - job.started_at
        if run <= 0:
            return
        j = self.jobs[job.id]
        a = j.attempt
        reporting = j.reports and a is not None and a.number == job.attempt
        for p in POINTS:
            t = start + run * p / 100.0
            common = (start, job.planned_s, job.time_limit, t)
            if reporting:
                assert a is not None
                got = expected_end(
                    *common,
                    self._progress(j, a, t),
                    predictions=self.config.plans_with_prediction,
                )
                ape = abs(got - now) / run
                self.ape["progress"][p].append(ape)
                if j.stop < 1.0:
                    self.ape_early[p].append(ape)
            else:
                for key, predictions in (
                    ("no_progress_plan", self.config.plans_with_prediction),
                    ("no_progress_prediction", True),
                ):
                    got = expected_end(*common, None, predictions=predictions)
                    self.ape[key][p].append(abs(got - now) / run)
        j.attempt = None

    def summary(self) -> dict[str, Any]:
        def med(values: list[float]) -> float | None:
            if not values:
                return None
            s = sorted(values)
            n = len(s)
            return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0

        m = self.model
        shown = self.started_shown
        return {
            "running_ends": {
                "progress_fraction": m.fraction,
                "early_stop_fraction": m.early_stop_fraction,
                "progress_noise": m.noise,
                "policy_reads_progress": self.reads,
                "reporting_jobs": sum(1 for j in self.jobs.values() if j.reports),
                "measured_jobs": {
                    key: len(v[POINTS[0]]) for key, v in self.ape.items()
                },
                # median APE of the predicted end at 25/50/75 % of the run
                "mdape_progress": {
                    str(p): med(v) for p, v in self.ape["progress"].items()
                },
                "mdape_progress_early_stopped": {
                    str(p): med(v) for p, v in self.ape_early.items()
                },
                "mdape_no_progress_plan": {
                    str(p): med(v) for p, v in self.ape["no_progress_plan"].items()
                },
                "mdape_no_progress_prediction": {
                    str(p): med(v)
                    for p, v in self.ape["no_progress_prediction"].items()
                },
            },
            "reservation_slips": {
                # jobs shown a start time before their first start, which
                # started; slipped: started past max(60 s, 10 % of the promised
                # wait) after one of those times
                "jobs_shown_a_start": shown,
                "slipped": len(self.slipped),
                "rate": len(self.slipped) / shown if shown else None,
            },
        }
