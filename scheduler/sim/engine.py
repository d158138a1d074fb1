"""The simulator's physics: a virtual clock, an event heap, and ``decide`` at the
same triggers as production (arrivals, completions, periodic).

The policy sees a ``ClusterState`` built like the Celery pass builds it: requests,
labels, limits, run times predicted from jobs finished so far, decayed usage. True
durations stay here. A preempted job is requeued with its original submit time and
restarts from scratch (no checkpoint credit).

Co-location (``--colocation``): a GPU has ``gpu_job_limit`` slots. A shareable
single-GPU job takes one slot (alone, a partner may join it later; or beside jobs
already there when its ``Start`` carries an admission); any other job takes every
slot of its GPUs. A job's remaining work is kept in solo-seconds: it progresses at
rate 1 alone and at its normalised co-located throughput from the table beside a
partner (the product over partners beside several). Every change of a GPU's
occupants re-rates its jobs and re-schedules their ends (a stale END event is
skipped by the job's ``epoch``); time limits stay wall-clock, so a slowed job may
time out. Joining a partner the table marks infeasible (or lacks) fails with an
out-of-memory error ``oom_after_s`` after the start (unless that partner left
first: then it loads and runs): the joiner is requeued (age kept), its partner never
noticed it. ``Evict`` stops a job at once and requeues it (age kept); its attempt's
work is lost. What the policy learns comes from the noisy progress reports of
``colocation.Meter``, never from the table.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from scheduler.policy import (
    ClassSpec,
    ClusterState,
    Evict,
    GpuView,
    NodeView,
    PassResult,
    PassStats,
    PendingJob,
    PolicyConfig,
    Preempt,
    RunningJob,
    Start,
    Usage,
    Wait,
    run_pass,
)
from scheduler.policy.interference import Knowledge
from scheduler.policy.predict import HISTORY, predict
from scheduler.sim.colocation import Meter, Segment
from scheduler.sim.trace import throughput

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping, Sequence

    from agents.spec import NodeSpec
    from scheduler.policy import Decision
    from scheduler.policy.colocate import Admission
    from scheduler.sim.colocation import ColocationTable
    from scheduler.sim.trace import SimJob, Throughputs

# Event kinds, in the order events at one timestamp are applied.
END = 0
PREEMPT_DONE = 1
OOM_FAIL = 2
ARRIVAL = 3
PERIODIC = 4
TRIAL_WINDOW_S = 3600.0  # ClusterState.trials_last_hour

CLASSES: MappingProxyType[str, ClassSpec] = MappingProxyType(
    {
        "high": ClassSpec("high", 1.0, preemptible=False, slowdown_cap=1.5),
        "normal": ClassSpec("normal", 0.5, preemptible=False, slowdown_cap=1.5),
        "best-effort": ClassSpec(
            "best-effort", 0.0, preemptible=True, slowdown_cap=None
        ),
    }
)
SLIP_TOLERANCE_S = 60.0


class PolicyContractError(RuntimeError):
    """``decide`` returned a decision the physics cannot apply (a policy bug)."""


class InvariantError(AssertionError):
    """A simulator invariant failed (a simulator bug)."""


@dataclass
class SimOptions:
    period_s: float = 60.0
    half_life_s: float = 7 * 86400.0
    history_n: int = HISTORY  # the production rule reads this many
    preempt_grace_s: float = 30.0
    sample_s: float = 3600.0
    check: bool = True
    gpu_job_limit: int = 2  # slots per GPU (GPULAB_GPU_JOB_LIMIT)
    oom_after_s: float = 5.0  # a job that cannot fit beside its partner fails then
    seed: int = 0  # draws the progress reports' noise


@dataclass
class SimResult:
    jobs: list[SimJob]
    passes: int = 0
    passes_by_trigger: Counter[str] = field(default_factory=Counter)
    periodic_skipped: int = 0
    decide_ms: list[float] = field(default_factory=list)
    preemptions: int = 0
    lost_gpu_s: float = 0.0  # work thrown away by preemptions
    busy_gpu_s: float = 0.0  # time GPUs held at least one job
    shared_gpu_s: float = 0.0  # time GPUs held two jobs or more
    # co-location: one entry per (joiner, partner) of each shared start:
    # (time, joiner id, partner id, trial, true combined normalised throughput;
    # 0 for a pair that does not fit)
    admissions: list[tuple[float, int, int, bool, float]] = field(default_factory=list)
    requeues: int = 0  # OOM failures and evictions
    oom_failures: int = 0
    evictions: int = 0
    oom_lost_gpu_s: float = 0.0  # GPU time held by attempts that failed OOM
    evicted_work_s: float = 0.0  # solo-seconds done by evicted attempts
    shared_timeouts: int = 0  # timed out in an attempt that shared a GPU
    observations: int = 0  # sharing episodes that became knowledge
    # a job truly over its cap longer than this was not stopped in time: the
    # detection window plus one pass period (when the pass that sees it runs)
    over_cap_window_s: float = 0.0
    total_gpus: int = 0
    slipped: int = 0
    with_est_start: int = 0
    throughput_fallbacks: int = 0
    samples: list[tuple[float, int, int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    # ``PassStats`` summed over the passes: seconds and passes per stage, passes
    # by stop reason, and the counts (considered, started, ...)
    stage_s: dict[str, float] = field(default_factory=dict)
    stage_passes: Counter[str] = field(default_factory=Counter)
    passes_by_stop: Counter[str] = field(default_factory=Counter)
    pass_counts: Counter[str] = field(default_factory=Counter)

    def record(self, stats: PassStats) -> None:
        """Add one pass's ``PassStats``."""
        for stage, seconds in stats.stage_s.items():
            self.stage_s[stage] = self.stage_s.get(stage, 0.0) + seconds
            self.stage_passes[stage] += 1
        self.passes_by_stop[stats.stop_reason] += 1
        counts = self.pass_counts
        counts["considered"] += stats.considered
        counts["started"] += stats.started
        counts["preempted"] += stats.preempted
        counts["reserved"] += stats.reserved
        counts["backfilled"] += stats.backfilled


class DecayedUsage:
    """Half-life-decayed GPU-seconds per key, accrued from a rate (GPUs in use),
    in O(1) per rate change: values are kept scaled by 2^((t - t0)/H)."""

    def __init__(self, half_life_s: float, t0: float = 0.0) -> None:
        self.h = half_life_s
        self.k = half_life_s / math.log(2)
        self.t0 = t0
        self.scaled: dict[object, float] = {}
        self.rate: dict[object, float] = {}
        self.last: dict[object, float] = {}

    def _e(self, t: float) -> float:
        return float(2.0 ** ((t - self.t0) / self.h))

    def _fold(self, key: object, t: float) -> None:
        rate = self.rate.get(key, 0.0)
        if rate:
            last = self.last[key]
            self.scaled[key] = self.scaled.get(key, 0.0) + rate * self.k * (
                self._e(t) - self._e(last)
            )
        self.last[key] = t

    def add_rate(self, key: object, t: float, delta: float) -> None:
        if (t - self.t0) / self.h > 500:
            self._renormalise(t)
        self._fold(key, t)
        self.rate[key] = self.rate.get(key, 0.0) + delta
        self.scaled.setdefault(key, 0.0)

    def _renormalise(self, t: float) -> None:
        values = self.values(t)
        self.t0 = t
        self.scaled = dict(values)
        self.last = dict.fromkeys(values, t)

    def values(self, t: float) -> dict[object, float]:
        e_now = self._e(t)
        out = {}
        for key, s in self.scaled.items():
            rate = self.rate.get(key, 0.0)
            if rate:
                s += rate * self.k * (e_now - self._e(self.last[key]))
            out[key] = s / e_now
        return out


class Simulator:
    def __init__(
        self,
        jobs: Sequence[SimJob],
        nodes: Sequence[NodeSpec],
        config: PolicyConfig,
        options: SimOptions | None = None,
        *,
        throughputs: Throughputs | None = None,
        colocation: ColocationTable | None = None,
        decide_fn: Callable[[ClusterState], list[Decision]] | None = None,
        pass_fn: Callable[[ClusterState], PassResult] = run_pass,
    ) -> None:
        """``pass_fn``: the pass (``policy.run_pass``: its decisions and
        ``PassStats``); ``decide_fn``, when given, replaces it with a bare decision
        function (a test's policy) whose passes record no ``PassStats``."""
        self.opts = options or SimOptions()
        if self.opts.gpu_job_limit < 1:
            raise ValueError("gpu_job_limit must be >= 1")
        self.config = config
        self.decide = decide_fn
        self.run_pass = pass_fn
        self.table = throughputs
        self.colocation = colocation
        # progress reports are measured only when there is something to share
        self.meter = Meter(seed=self.opts.seed) if colocation is not None else None
        self.jobs = list(jobs)
        self.by_id = {j.id: j for j in self.jobs}
        if len(self.by_id) != len(self.jobs):
            raise ValueError("job ids must be unique")
        # Cluster: node ids 1.., GPU ids 1.. (index order within a node).
        self.nodes = tuple(
            NodeView(i + 1, f"node{i + 1:04d}") for i in range(len(nodes))
        )
        self.slots = self.opts.gpu_job_limit
        self.gpu_node: dict[int, int] = {}
        self.gpu_model: dict[int, str] = {}
        self.gpu_mem: dict[int, int] = {}
        self.free_view: dict[int, GpuView] = {}
        self.views: dict[tuple[int, int], GpuView] = {}  # (gpu, free slots)
        gid = 0
        for node_id, spec in enumerate(nodes, start=1):
            for index in range(spec.gpus):
                gid += 1
                peers = (
                    tuple(i for i in range(spec.gpus) if i != index)
                    if spec.nvlink
                    else ()
                )
                view = GpuView(
                    id=gid,
                    node_id=node_id,
                    index=index,
                    memory_total_mib=spec.memory_mib,
                    slots=self.slots,
                    free_slots=self.slots,
                    model=spec.model,
                    nvlink_peers=peers,
                )
                self.free_view[gid] = view
                self.gpu_node[gid] = node_id
                self.gpu_model[gid] = spec.model
                self.gpu_mem[gid] = spec.memory_mib
        self.total_gpus = gid
        # GPU id -> its jobs in arrival order, and the slots they take
        self.occupants: dict[int, list[int]] = {}
        self.used: dict[int, int] = {}
        self.gpu_since: dict[int, float] = {}  # last change of its occupants
        self.shared_gpus: set[int] = set()  # GPUs where 2+ jobs progress together
        self.gpu_list: list[GpuView] = [self.free_view[g] for g in range(1, gid + 1)]
        self.gpu_tuple: tuple[GpuView, ...] | None = None
        # Queues and views.
        self.pending: dict[int, SimJob] = {}
        self.pending_views: dict[int, PendingJob] = {}
        self.pending_by_user: dict[str, set[int]] = {}
        self.running: dict[int, SimJob] = {}
        self.running_views: dict[int, RunningJob] = {}
        self.recently_preempted: set[int] = set()
        self.stale_views: set[int] = set()  # running jobs whose view changed
        # exploration trials started: (time, unordered workload pair)
        self.trials: deque[tuple[float, frozenset[str]]] = deque()
        # History for run-time prediction (completed jobs only).
        self.hist_label: dict[tuple[str, str], deque[float]] = {}
        self.hist_user: dict[str, deque[float]] = {}
        self.user_version: dict[str, int] = {}
        self.stale_users: set[str] = set()
        self.usage = DecayedUsage(self.opts.half_life_s)
        self.groups = sorted({j.group for j in self.jobs})
        self.users = sorted({(j.group, j.user) for j in self.jobs})
        self.group_shares = MappingProxyType(dict.fromkeys(self.groups, 1.0))
        self.user_shares = MappingProxyType(dict.fromkeys(self.users, 1.0))
        # Events.
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.real_events = 0  # non-periodic events in the heap
        self.periodic_at: float | None = None
        self.dirty = False
        self.result = SimResult(
            jobs=self.jobs,
            total_gpus=self.total_gpus,
            over_cap_window_s=config.colo_detect_window_s + self.opts.period_s,
        )
        self.finished = 0

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, job_id: int = 0, stamp: int = 0) -> None:
        """``stamp``: the job's ``epoch`` for END, its ``attempt`` otherwise."""
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, job_id, stamp))
        if kind != PERIODIC:
            self.real_events += 1

    def run(self) -> SimResult:
        wall = time.perf_counter()
        for job in self.jobs:
            self._push(job.submit, ARRIVAL, job.id)
        next_sample = 0.0
        heap = self.heap
        while heap:
            now = heap[0][0]
            while next_sample <= now and self.opts.sample_s > 0:
                self._sample(next_sample)
                next_sample += self.opts.sample_s
            changed = False
            periodic = False
            while heap and heap[0][0] == now:
                _, kind, _, job_id, stamp = heapq.heappop(heap)
                if kind == PERIODIC:
                    periodic = True
                    self.periodic_at = None
                    continue
                self.real_events -= 1
                job = self.by_id[job_id]
                if kind == ARRIVAL:
                    self._arrive(job)
                    changed = True
                elif kind == END:
                    if job.epoch == stamp and job.state in ("running", "stopping"):
                        self._end(job, now)
                        changed = True
                elif job.attempt == stamp:
                    if kind == PREEMPT_DONE and job.state == "stopping":
                        self._requeue(job, now)
                        changed = True
                    elif kind == OOM_FAIL and job.doomed:
                        self._oom(job, now)
                        changed = True
            if changed:
                self.dirty = True
                self._pass(now, "event")
            elif periodic:
                if self.dirty:
                    self._pass(now, "periodic")
                else:
                    self.result.periodic_skipped += 1
            if self.real_events == 0 and not self.dirty:
                break  # nothing can change any more: the rest would be skipped
            if self.periodic_at is None and (self.pending or self.running):
                self.periodic_at = now + self.opts.period_s
                self._push(self.periodic_at, PERIODIC)
        self._final_checks()
        if self.meter is not None:
            self.result.observations = self.meter.observed
        self.result.wall_s = time.perf_counter() - wall
        return self.result

    def _sample(self, t: float) -> None:
        busy = len(self.occupants)
        self.result.samples.append(
            (t, len(self.pending), len(self.running), busy / self.total_gpus)
        )

    # ------------------------------------------------------------------ physics

    def _arrive(self, job: SimJob) -> None:
        job.state = "pending"
        self._enqueue(job)

    def _enqueue(self, job: SimJob) -> None:
        self.pending[job.id] = job
        self.pending_by_user.setdefault(job.user, set()).add(job.id)
        self.pending_views[job.id] = self._pending_view(job)

    def _predict(self, job: SimJob) -> tuple[float | None, str]:
        """``policy.predict.predict`` over the user's completed runs with the same
        label, else over all of the user's: the production rule."""
        if job.label:
            hist = self.hist_label.get((job.user, job.label))
            if hist:
                return predict(hist), "user+label"
        hist_u = self.hist_user.get(job.user)
        if hist_u:
            return predict(hist_u), "user"
        return None, "default"

    def _pending_view(self, job: SimJob) -> PendingJob:
        predicted, source = self._predict(job)
        job.planned_s = (
            job.time_limit if predicted is None else min(job.time_limit, predicted)
        )
        job.pred_source = source
        job.pred_version = self.user_version.get(job.user, 0)
        cls = CLASSES[job.priority_class]
        return PendingJob(
            id=job.id,
            gpus=job.gpus,
            gpu_memory_mib=job.gpu_mem_mib,
            priority_weight=cls.weight,
            submitted_at=job.submit,
            user=job.user,
            group=job.group,
            priority_class=job.priority_class,
            time_limit_s=job.time_limit,
            planned_s=job.planned_s,
            shareable=job.shareable,
            workload=job.label,
            slowdown_cap=cls.slowdown_cap,
        )

    def _solo_key(self, job: SimJob) -> tuple[str, str]:
        return job.label, self.gpu_model[job.gpu_ids[0]].lower()

    def _running_view(self, job: SimJob, now: float) -> RunningJob:
        recent = sum(1 for t in job.preempt_times if now - t < 3600.0)
        cls = CLASSES[job.priority_class]
        measured: float | None = None
        measured_for = 0.0
        seg = job.segment
        if seg is not None and seg.partners and self.meter is not None:
            log_r = self.meter.log_slowdown(seg, self._solo_key(job))
            if log_r is not None:
                measured = math.exp(log_r)
                measured_for = seg.measured_s
        return RunningJob(
            id=job.id,
            gpu_ids=job.gpu_ids,
            started_at=job.started_at,
            planned_s=job.planned_s,
            time_limit_s=job.time_limit,
            user=job.user,
            group=job.group,
            priority_class=job.priority_class,
            preemptible=cls.preemptible and job.state == "running",
            preemptions_last_hour=recent,
            shareable=job.shareable,
            workload=job.label,
            gpu_memory_mib=job.gpu_mem_mib,
            peak_memory_mib=job.gpu_mem_mib,  # the sim's jobs use what they declare
            slowdown_cap=cls.slowdown_cap,
            joined_at=job.joined_at,
            trial=job.trial,
            measured_slowdown=measured,
            measured_for_s=measured_for,
        )

    def _true_duration(self, job: SimJob, start: Start) -> float:
        if job.steps is None or self.table is None:
            return job.ref_duration
        model = self.gpu_model[start.placements[0].gpu_ids[0]]
        rate = throughput(
            self.table,
            model,
            job.label,
            job.gpus,
            consolidated=len(start.placements) == 1,
        )
        if not rate:
            self.result.throughput_fallbacks += 1
            return job.ref_duration
        return job.steps / rate

    def _check_join(self, job: SimJob, start: Start, adm: Admission) -> None:
        """A ``Start`` with an admission takes one slot of a GPU that runs jobs
        which all took one slot, and names exactly those jobs as partners."""
        where = f"shared Start for job {job.id}"
        if job.gpus != 1 or len(start.gpu_ids) != 1:
            raise PolicyContractError(f"{where}: only single-GPU jobs share")
        if not job.shareable:
            raise PolicyContractError(f"{where}: the job is not shareable")
        g = start.gpu_ids[0]
        occ = self.occupants.get(g)
        if not occ:
            raise PolicyContractError(f"{where}: GPU {g} runs no job to join")
        for o in occ:
            if self.by_id[o].slots_taken != 1:
                raise PolicyContractError(
                    f"{where}: GPU {g} is held exclusively by job {o}"
                )
        if self.used[g] + 1 > self.slots:
            raise PolicyContractError(
                f"{where}: GPU {g} already has {len(occ)} job(s), its limit is "
                f"{self.slots} (over-allocation)"
            )
        if set(adm.partners) != set(occ):
            raise PolicyContractError(
                f"{where}: admission names partners {sorted(adm.partners)}, GPU {g}"
                f" runs {sorted(occ)}"
            )

    def _start(self, start: Start, now: float) -> None:
        job = self.by_id.get(start.job_id)
        if job is None or job.state != "pending":
            raise PolicyContractError(
                f"Start for job {start.job_id}, which is not pending"
            )
        gpu_ids = start.gpu_ids
        if len(gpu_ids) != job.gpus or len(set(gpu_ids)) != len(gpu_ids):
            raise PolicyContractError(
                f"Start for job {job.id} names {len(gpu_ids)} GPU(s) "
                f"({len(set(gpu_ids))} distinct), it asked for {job.gpus}"
            )
        adm = start.admission
        for placement in start.placements:
            for g in placement.gpu_ids:
                if self.gpu_node.get(g) != placement.node_id:
                    raise PolicyContractError(
                        f"Start for job {job.id}: GPU {g} is not on node "
                        f"{placement.node_id}"
                    )
                if adm is None and g in self.occupants:
                    raise PolicyContractError(
                        f"Start for job {job.id}: GPU {g} is already taken by "
                        f"job {self.occupants[g][0]} (over-allocation)"
                    )
                if job.gpu_mem_mib is not None and self.gpu_mem[g] < job.gpu_mem_mib:
                    raise PolicyContractError(
                        f"Start for job {job.id}: GPU {g} has less memory than asked"
                    )
        if adm is not None:
            self._check_join(job, start, adm)
        del self.pending[job.id]
        del self.pending_views[job.id]
        self.pending_by_user[job.user].discard(job.id)
        job.state = "running"
        job.attempt += 1
        job.started_at = now
        job.gpu_ids = gpu_ids
        if job.first_start is None:
            job.first_start = now
            if job.first_est is not None and now > job.first_est + SLIP_TOLERANCE_S:
                self.result.slipped += 1
        job.run_duration = self._true_duration(job, start)
        job.slots_taken = 1 if job.shareable and job.gpus == 1 else self.slots
        job.done_work = 0.0
        job.rate = 1.0
        job.rate_since = now
        job.progress_from = now
        job.partners = ()
        job.segment = None
        job.shared_attempt = False
        job.joined_at = now if adm is not None else None
        job.trial = adm is not None and adm.trial
        job.doomed = adm is not None and self._admitted(job, adm, now)
        self.running[job.id] = job
        for g in gpu_ids:
            self._occupy(g, job, now)
        if job.doomed:
            job.rate = 0.0  # it dies loading, before it makes progress
            self._push(now + self.opts.oom_after_s, OOM_FAIL, job.id, job.attempt)
        elif job.gpus == 1:
            self._rerate(gpu_ids[0], now, force=(job.id,))
        else:
            self._set_rate(job, now, ())
        for g in gpu_ids:
            self._charge(g, now)
        self.running_views[job.id] = self._running_view(job, now)
        self.stale_views.discard(job.id)
        if job.preempt_times:
            self.recently_preempted.add(job.id)

    def _admitted(self, job: SimJob, adm: Admission, now: float) -> bool:
        """Count a shared start's pairs (trials apart) with their true combined
        throughput; True when the joiner cannot fit beside a partner (its
        partners are then the ones it fails beside)."""
        model = self.gpu_model[job.gpu_ids[0]]
        table = self.colocation
        oom: list[int] = []
        for p in adm.partners:
            other = self.by_id[p].label
            combined = table.combined(model, job.label, other) if table else 0.0
            self.result.admissions.append((now, job.id, p, adm.trial, combined))
            if adm.trial:
                self.trials.append((now, frozenset((job.label, other))))
            if table is None or table.norm(model, job.label, other) is None:
                oom.append(p)
        job.partners = tuple(oom)
        return bool(oom)

    # --- GPU occupancy, rates and usage

    def _gpu_view(self, g: int) -> GpuView:
        free = self.slots - self.used.get(g, 0)
        if free == self.slots:
            return self.free_view[g]
        view = self.views.get((g, free))
        if view is None:
            view = self.views[(g, free)] = replace(self.free_view[g], free_slots=free)
        return view

    def _account(self, g: int, now: float) -> None:
        """Busy and shared GPU time up to ``now``, before its occupants change."""
        n = len(self.occupants.get(g, ()))
        if n:
            dt = now - self.gpu_since[g]
            self.result.busy_gpu_s += dt
            if n > 1:
                self.result.shared_gpu_s += dt
        self.gpu_since[g] = now

    def _occupy(self, g: int, job: SimJob, now: float) -> None:
        self._account(g, now)
        self.occupants.setdefault(g, []).append(job.id)
        self.used[g] = self.used.get(g, 0) + job.slots_taken
        self.gpu_list[g - 1] = self._gpu_view(g)
        self.gpu_tuple = None

    def _vacate(self, g: int, job: SimJob, now: float) -> None:
        self._account(g, now)
        occ = self.occupants.get(g)
        if occ is None or job.id not in occ:
            raise InvariantError(f"GPU {g} was not held by job {job.id}")
        occ.remove(job.id)
        self.used[g] -= job.slots_taken
        if not occ:
            del self.occupants[g]
            del self.used[g]
        self.gpu_list[g - 1] = self._gpu_view(g)
        self.gpu_tuple = None

    def _charge(self, g: int, now: float) -> None:
        """Usage: a GPU shared by n jobs charges each 1/n (DESIGN: accounting)."""
        occ = self.occupants.get(g, ())
        for jid in occ:
            job = self.by_id[jid]
            self._set_usage(job, now, job.gpus if job.gpus > 1 else 1.0 / len(occ))

    def _set_usage(self, job: SimJob, now: float, weight: float) -> None:
        delta = weight - job.usage_w
        if delta:
            job.usage_w = weight
            self.usage.add_rate(("g", job.group), now, delta)
            self.usage.add_rate(("u", job.group, job.user), now, delta)

    def _rerate(self, g: int, now: float, force: Collection[int] = ()) -> None:
        """Re-rate the jobs progressing on ``g`` whose partners changed (a joiner
        about to fail out of memory is no one's partner)."""
        occ = self.occupants.get(g, ())
        live = [j for j in occ if not self.by_id[j].doomed]
        for jid in live:
            job = self.by_id[jid]
            partners = tuple(o for o in live if o != jid)
            if jid in force or partners != job.partners:
                self._set_rate(job, now, partners)
        if len(live) > 1:
            self.shared_gpus.add(g)
        else:
            self.shared_gpus.discard(g)

    def _fold(self, job: SimJob, now: float) -> None:
        job.done_work += job.rate * (now - job.rate_since)
        job.rate_since = now

    def _set_rate(self, job: SimJob, now: float, partners: tuple[int, ...]) -> None:
        self._fold(job, now)
        self._close_segment(job, now)
        rate = 1.0
        if partners:
            table = self.colocation
            model = self.gpu_model[job.gpu_ids[0]]
            for p in partners:
                norm = (
                    table.norm(model, job.label, self.by_id[p].label) if table else None
                )
                if norm is None:
                    raise InvariantError(
                        f"job {job.id} progresses beside job {p}, a pair that does"
                        " not fit"
                    )
                rate *= norm
            job.shared_attempt = True
        job.rate = rate
        job.partners = partners
        if self.meter is not None:
            job.segment = Segment(now, rate, partners)
        self.stale_views.add(job.id)
        # its end at this rate, or its (wall-clock) limit if that comes first
        left = max(job.run_duration - job.done_work, 0.0)
        t_done = now + left / rate
        t_limit = job.started_at + job.time_limit
        job.epoch += 1
        if t_done <= t_limit:
            job.end_cause = "completed"
            self._push(t_done, END, job.id, job.epoch)
        else:
            job.end_cause = "timeout"
            self._push(t_limit, END, job.id, job.epoch)

    def _close_segment(self, job: SimJob, now: float) -> None:
        """End ``job``'s constant-rate stretch: draw the reports it owes; a sharing
        episode also updates the job's true-slowdown record and, with one partner
        and enough reports, becomes an observation of the pair."""
        seg = job.segment
        if seg is None:
            return
        job.segment = None
        meter = self.meter
        assert meter is not None
        key = self._solo_key(job)
        meter.advance(seg, now, key)
        if not seg.partners:
            return
        length = now - seg.start
        if length > 0:
            true = 1.0 / seg.rate
            job.shared_s += length
            job.max_true_slowdown = max(job.max_true_slowdown, true)
            cap = CLASSES[job.priority_class].slowdown_cap
            if cap is not None and true > cap:
                job.over_cap_s = max(job.over_cap_s, length)
        if len(seg.partners) == 1:
            meter.episode_ended(seg, key, self.by_id[seg.partners[0]].label)

    def _release(self, job: SimJob, now: float) -> float:
        ran = now - job.started_at
        if not job.doomed:
            self._fold(job, now)
            self._close_segment(job, now)
        for g in job.gpu_ids:
            self._vacate(g, job, now)
        del self.running[job.id]
        del self.running_views[job.id]
        self.recently_preempted.discard(job.id)
        self.stale_views.discard(job.id)
        self._set_usage(job, now, 0.0)
        job.partners = ()
        for g in job.gpu_ids:
            self._charge(g, now)
            self._rerate(g, now, self._spared(g, job, now))
        return ran

    def _spared(self, g: int, gone: SimJob, now: float) -> list[int]:
        """Joiners of ``g`` that were going to fail beside ``gone`` and now fit
        (every partner they could not fit beside left before their failure): they
        load and start progressing now."""
        spared = []
        for o in self.occupants.get(g, ()):
            other = self.by_id[o]
            if other.doomed and gone.id in other.partners:
                other.partners = tuple(p for p in other.partners if p != gone.id)
                if not other.partners:
                    other.doomed = False  # its OOM event goes stale
                    other.progress_from = now
                    spared.append(o)
        return spared

    def _end(self, job: SimJob, now: float) -> None:
        if job.state == "done":
            raise InvariantError(f"job {job.id} finished twice")
        ran = self._release(job, now)
        job.outcome = job.end_cause
        if job.outcome == "completed":
            # work conserved: the rates integrate to the job's solo work
            if abs(job.done_work - job.run_duration) > 1e-6 * max(
                1.0, job.run_duration
            ):
                raise InvariantError(
                    f"job {job.id} completed with {job.done_work} of its "
                    f"{job.run_duration} solo-seconds of work done"
                )
            job.done_work = job.run_duration
        job.run_total += ran
        job.end = now
        job.state = "done"
        self.finished += 1
        if job.outcome == "timeout":
            if job.shared_attempt:
                self.result.shared_timeouts += 1
        else:
            n = self.opts.history_n
            if job.label:
                self.hist_label.setdefault(
                    (job.user, job.label), deque(maxlen=n)
                ).append(ran)
            self.hist_user.setdefault(job.user, deque(maxlen=n)).append(ran)
            self.user_version[job.user] = self.user_version.get(job.user, 0) + 1
            self.stale_users.add(job.user)

    def _preempt(self, decision: Preempt, now: float) -> None:
        job = self.by_id.get(decision.victim_id)
        view = self.running_views.get(decision.victim_id)
        if job is None or view is None or job.state != "running":
            raise PolicyContractError(
                f"Preempt of job {decision.victim_id}, which is not running"
            )
        if not view.preemptible:
            raise PolicyContractError(
                f"Preempt of job {job.id}, which is not preemptible"
            )
        job.state = "stopping"
        job.preemptions += 1
        job.preempt_times.append(now)
        self.result.preemptions += 1
        self.running_views[job.id] = self._running_view(job, now)
        self._push(now + self.opts.preempt_grace_s, PREEMPT_DONE, job.id, job.attempt)

    def _back_to_queue(self, job: SimJob, ran: float) -> None:
        """Requeue after a stopped attempt: original submit time (age kept), no
        checkpoint credit; its pending END and OOM events go stale."""
        job.run_total += ran
        job.attempt += 1
        job.epoch += 1
        job.doomed = False
        job.state = "pending"
        job.gpu_ids = ()
        self._enqueue(job)

    def _requeue(self, job: SimJob, now: float) -> None:
        ran = self._release(job, now)
        self.result.lost_gpu_s += ran * job.gpus
        self._back_to_queue(job, ran)

    def _evict(self, decision: Evict, now: float) -> None:
        job = self.by_id.get(decision.job_id)
        if job is None or job.state not in ("running", "stopping"):
            raise PolicyContractError(
                f"Evict of job {decision.job_id}, which is not running"
            )
        occ = self.occupants.get(job.gpu_ids[0], ()) if job.gpus == 1 else ()
        if decision.partner_id == job.id or decision.partner_id not in occ:
            raise PolicyContractError(
                f"Evict of job {job.id}: job {decision.partner_id} does not share "
                "its GPU"
            )
        partner = self.by_id[decision.partner_id]
        ran = self._release(job, now)
        self.result.requeues += 1
        self.result.evictions += 1
        self.result.evicted_work_s += job.done_work
        if self.meter is not None:
            self.meter.refuse(job.label, partner.label)
        self._back_to_queue(job, ran)

    def _oom(self, job: SimJob, now: float) -> None:
        """The joiner could not fit beside its partner: it fails at start and is
        requeued (age kept). The pair goes to ``Knowledge.harmful`` so it is not
        admitted again: the simulator's choice (production has no writer for an
        out-of-memory pair yet, docs/colocation.md), without which a policy would
        retry the pair at every pass while its partner runs."""
        beside = job.partners
        ran = self._release(job, now)
        self.result.requeues += 1
        self.result.oom_failures += 1
        self.result.oom_lost_gpu_s += ran
        if self.meter is not None:
            for p in beside:
                self.meter.refuse(job.label, self.by_id[p].label)
        self._back_to_queue(job, ran)

    # ------------------------------------------------------------------ the pass

    def _state(self, now: float) -> ClusterState:
        for user in self.stale_users:
            version = self.user_version.get(user, 0)
            for job_id in self.pending_by_user.get(user, ()):
                job = self.pending[job_id]
                if job.pred_version != version:
                    self.pending_views[job_id] = self._pending_view(job)
        self.stale_users.clear()
        refresh = self.recently_preempted | self.stale_views
        self.stale_views.clear()
        knowledge = Knowledge()
        trials: Mapping[frozenset[str], int] = MappingProxyType({})
        meter = self.meter
        if meter is not None:
            # the reports that arrived since the last pass (solo ones feed the
            # workloads' solo rates), and every sharing job's measurement
            for job in self.running.values():
                seg = job.segment
                if seg is not None:
                    meter.advance(seg, now, self._solo_key(job))
                    if seg.partners:
                        refresh.add(job.id)
            knowledge = meter.knowledge()
        while self.trials and self.trials[0][0] <= now - TRIAL_WINDOW_S:
            self.trials.popleft()
        if self.trials:
            trials = MappingProxyType(Counter(p for _, p in self.trials))
        for job_id in refresh:
            self.running_views[job_id] = self._running_view(self.by_id[job_id], now)
        if self.gpu_tuple is None:
            self.gpu_tuple = tuple(self.gpu_list)
        values = self.usage.values(now)
        group_usage: dict[str, float] = {}
        user_usage: dict[tuple[str, str], float] = {}
        for key, value in values.items():
            assert isinstance(key, tuple)
            if key[0] == "g":
                group_usage[key[1]] = value
            else:
                user_usage[(key[1], key[2])] = value
        return ClusterState(
            now=now,
            nodes=self.nodes,
            gpus=self.gpu_tuple,
            pending=tuple(self.pending_views.values()),
            running=tuple(self.running_views.values()),
            usage=Usage(
                group_usage=group_usage,
                user_usage=user_usage,
                group_shares=self.group_shares,
                user_shares=self.user_shares,
            ),
            classes=CLASSES,
            config=self.config,
            knowledge=knowledge,
            trials_last_hour=trials,
        )

    def _pass(self, now: float, trigger: str) -> None:
        state = self._state(now)
        t0 = time.perf_counter()
        if self.decide is not None:
            decisions = self.decide(state)
        else:
            got = self.run_pass(state)
            decisions = got.decisions
        self.result.decide_ms.append((time.perf_counter() - t0) * 1000.0)
        if self.decide is None:
            self.result.record(got.stats)
        self.result.passes += 1
        self.result.passes_by_trigger[trigger] += 1
        acted = False
        # evictions first: a start of this pass may take the evicted job's slot
        evicted: set[int] = set()
        for d in decisions:
            if isinstance(d, Evict) and d.job_id not in evicted:
                evicted.add(d.job_id)
                self._evict(d, now)
                acted = True
        preempts: list[Preempt] = []
        for d in decisions:
            if isinstance(d, Start):
                self._start(d, now)
                acted = True
            elif isinstance(d, Preempt):
                preempts.append(d)
            elif isinstance(d, Wait):
                job = self.by_id.get(d.job_id)
                if job is not None:
                    job.last_reason = str(d.reason)
                    if d.est_start is not None and job.first_est is None:
                        job.first_est = d.est_start
                        if job.first_start is None:
                            self.result.with_est_start += 1
        seen: set[int] = set()
        for p in preempts:
            job = self.by_id.get(p.victim_id)
            if p.victim_id in seen or (job is not None and job.state == "stopping"):
                continue  # already being stopped
            seen.add(p.victim_id)
            self._preempt(p, now)
            acted = True
        # while GPUs are shared the measurements move (the pass may evict), and
        # while trials are recent the exploration budget refills: keep watching
        self.dirty = acted or bool(self.shared_gpus) or bool(self.trials)
        if self.opts.check:
            self._check()

    # ------------------------------------------------------------------ invariants

    def _check(self) -> None:
        held = 0
        for job in self.running.values():
            for g in job.gpu_ids:
                if job.id not in self.occupants.get(g, ()):
                    raise InvariantError(f"GPU {g} of job {job.id} not held by it")
            held += len(job.gpu_ids)
        if held != sum(len(o) for o in self.occupants.values()):
            raise InvariantError("GPU occupants and running jobs disagree")
        if len(self.occupants) > self.total_gpus:
            raise InvariantError("more GPUs allocated than exist")
        for g, occ in self.occupants.items():
            taken = sum(self.by_id[j].slots_taken for j in occ)
            if taken != self.used[g] or taken > self.slots or len(occ) > self.slots:
                raise InvariantError(
                    f"GPU {g} holds {len(occ)} job(s) taking {taken} slot(s) of "
                    f"{self.slots}"
                )
            if len(occ) > 1:
                for j in occ:
                    job = self.by_id[j]
                    if job.gpus != 1 or not job.shareable:
                        raise InvariantError(
                            f"job {j} ({job.gpus} GPUs, shareable={job.shareable})"
                            f" shares GPU {g}"
                        )

    def _final_checks(self) -> None:
        done = [j for j in self.jobs if j.state == "done"]
        if len(done) != self.finished:
            raise InvariantError("a job finished more than once or not recorded")
        for job in done:
            final_run = job.end - job.started_at
            if job.outcome == "timeout":
                expected = job.time_limit
            elif not job.shared_attempt:
                expected = job.progress_from - job.started_at + job.run_duration
            else:
                continue  # its work was checked at its end (``_end``)
            if abs(final_run - expected) > 1e-6 * max(1.0, expected):
                raise InvariantError(
                    f"job {job.id}: ran {final_run} s in its last attempt, "
                    f"its true duration (or limit) is {expected} s"
                )
