"""The simulator's physics: a virtual clock, an event heap, and ``decide`` at the
same triggers as production (arrivals, completions, periodic).

The policy sees a ``ClusterState`` built like the Celery pass builds it: requests,
labels, limits, run times predicted from jobs finished so far, decayed usage. True
durations stay here. A preempted job is requeued with its original submit time and
restarts from scratch (no checkpoint credit).
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
    GpuView,
    NodeView,
    PendingJob,
    PolicyConfig,
    Preempt,
    RunningJob,
    Start,
    Usage,
    Wait,
    decide,
)
from scheduler.policy.predict import HISTORY, predict
from scheduler.sim.trace import throughput

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from agents.spec import NodeSpec
    from scheduler.policy import Decision
    from scheduler.sim.trace import SimJob, Throughputs

# Event kinds, in the order events at one timestamp are applied.
END = 0
PREEMPT_DONE = 1
ARRIVAL = 2
PERIODIC = 3

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


@dataclass
class SimResult:
    jobs: list[SimJob]
    passes: int = 0
    passes_by_trigger: Counter[str] = field(default_factory=Counter)
    periodic_skipped: int = 0
    decide_ms: list[float] = field(default_factory=list)
    preemptions: int = 0
    lost_gpu_s: float = 0.0  # work thrown away by preemptions
    busy_gpu_s: float = 0.0
    total_gpus: int = 0
    slipped: int = 0
    with_est_start: int = 0
    throughput_fallbacks: int = 0
    samples: list[tuple[float, int, int, float]] = field(default_factory=list)
    wall_s: float = 0.0


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
        decide_fn: Callable[[ClusterState], list[Decision]] = decide,
    ) -> None:
        self.opts = options or SimOptions()
        self.config = config
        self.decide = decide_fn
        self.table = throughputs
        self.jobs = list(jobs)
        self.by_id = {j.id: j for j in self.jobs}
        if len(self.by_id) != len(self.jobs):
            raise ValueError("job ids must be unique")
        # Cluster: node ids 1.., GPU ids 1.. (index order within a node).
        self.nodes = tuple(
            NodeView(i + 1, f"node{i + 1:04d}") for i in range(len(nodes))
        )
        self.gpu_node: dict[int, int] = {}
        self.gpu_model: dict[int, str] = {}
        self.gpu_mem: dict[int, int] = {}
        self.free_view: dict[int, GpuView] = {}
        self.busy_view: dict[int, GpuView] = {}
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
                    slots=1,
                    free_slots=1,
                    model=spec.model,
                    nvlink_peers=peers,
                )
                self.free_view[gid] = view
                self.busy_view[gid] = replace(view, free_slots=0)
                self.gpu_node[gid] = node_id
                self.gpu_model[gid] = spec.model
                self.gpu_mem[gid] = spec.memory_mib
        self.total_gpus = gid
        self.owner: dict[int, int] = {}  # gpu id -> job id
        self.gpu_list: list[GpuView] = [self.free_view[g] for g in range(1, gid + 1)]
        self.gpu_tuple: tuple[GpuView, ...] | None = None
        # Queues and views.
        self.pending: dict[int, SimJob] = {}
        self.pending_views: dict[int, PendingJob] = {}
        self.pending_by_user: dict[str, set[int]] = {}
        self.running: dict[int, SimJob] = {}
        self.running_views: dict[int, RunningJob] = {}
        self.recently_preempted: set[int] = set()
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
        self.result = SimResult(jobs=self.jobs, total_gpus=self.total_gpus)
        self.finished = 0

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, job_id: int = 0, attempt: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, job_id, attempt))
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
                _, kind, _, job_id, attempt = heapq.heappop(heap)
                if kind == PERIODIC:
                    periodic = True
                    self.periodic_at = None
                    continue
                self.real_events -= 1
                job = self.by_id[job_id]
                if kind == ARRIVAL:
                    self._arrive(job)
                    changed = True
                elif job.attempt == attempt:
                    if kind == END and job.state in ("running", "stopping"):
                        self._end(job, now)
                        changed = True
                    elif kind == PREEMPT_DONE and job.state == "stopping":
                        self._requeue(job, now)
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
        self.result.wall_s = time.perf_counter() - wall
        return self.result

    def _sample(self, t: float) -> None:
        busy = len(self.owner)
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
        )

    def _running_view(self, job: SimJob, now: float) -> RunningJob:
        recent = sum(1 for t in job.preempt_times if now - t < 3600.0)
        return RunningJob(
            id=job.id,
            gpu_ids=job.gpu_ids,
            started_at=job.started_at,
            planned_s=job.planned_s,
            time_limit_s=job.time_limit,
            user=job.user,
            group=job.group,
            priority_class=job.priority_class,
            preemptible=CLASSES[job.priority_class].preemptible
            and job.state == "running",
            preemptions_last_hour=recent,
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
        for placement in start.placements:
            for g in placement.gpu_ids:
                if self.gpu_node.get(g) != placement.node_id:
                    raise PolicyContractError(
                        f"Start for job {job.id}: GPU {g} is not on node "
                        f"{placement.node_id}"
                    )
                if g in self.owner:
                    raise PolicyContractError(
                        f"Start for job {job.id}: GPU {g} is already taken by "
                        f"job {self.owner[g]} (over-allocation)"
                    )
                if job.gpu_mem_mib is not None and self.gpu_mem[g] < job.gpu_mem_mib:
                    raise PolicyContractError(
                        f"Start for job {job.id}: GPU {g} has less memory than asked"
                    )
        for g in gpu_ids:
            self.owner[g] = job.id
            self.gpu_list[g - 1] = self.busy_view[g]
        self.gpu_tuple = None
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
        if job.run_duration > job.time_limit:
            end = now + job.time_limit
        else:
            end = now + job.run_duration
        self._push(end, END, job.id, job.attempt)
        self.running[job.id] = job
        self.running_views[job.id] = self._running_view(job, now)
        if job.preempt_times:
            self.recently_preempted.add(job.id)
        self._usage_rate(job, now, job.gpus)

    def _usage_rate(self, job: SimJob, now: float, delta: int) -> None:
        self.usage.add_rate(("g", job.group), now, delta)
        self.usage.add_rate(("u", job.group, job.user), now, delta)

    def _release(self, job: SimJob, now: float) -> float:
        ran = now - job.started_at
        for g in job.gpu_ids:
            if self.owner.pop(g, None) != job.id:
                raise InvariantError(f"GPU {g} was not held by job {job.id}")
            self.gpu_list[g - 1] = self.free_view[g]
        self.gpu_tuple = None
        del self.running[job.id]
        del self.running_views[job.id]
        self.recently_preempted.discard(job.id)
        self._usage_rate(job, now, -job.gpus)
        self.result.busy_gpu_s += ran * job.gpus
        return ran

    def _end(self, job: SimJob, now: float) -> None:
        if job.state == "done":
            raise InvariantError(f"job {job.id} finished twice")
        ran = self._release(job, now)
        job.run_total += ran
        job.end = now
        job.state = "done"
        self.finished += 1
        if job.run_duration > job.time_limit:
            job.outcome = "timeout"
        else:
            job.outcome = "completed"
            n = self.opts.history_n
            if job.label:
                self.hist_label.setdefault(
                    (job.user, job.label), deque(maxlen=n)
                ).append(job.run_duration)
            self.hist_user.setdefault(job.user, deque(maxlen=n)).append(
                job.run_duration
            )
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

    def _requeue(self, job: SimJob, now: float) -> None:
        ran = self._release(job, now)
        job.run_total += ran
        self.result.lost_gpu_s += ran * job.gpus
        job.attempt += 1  # invalidates the pending END event
        job.state = "pending"
        job.gpu_ids = ()
        self._enqueue(job)  # original submit time: age kept

    # ------------------------------------------------------------------ the pass

    def _state(self, now: float) -> ClusterState:
        for user in self.stale_users:
            version = self.user_version.get(user, 0)
            for job_id in self.pending_by_user.get(user, ()):
                job = self.pending[job_id]
                if job.pred_version != version:
                    self.pending_views[job_id] = self._pending_view(job)
        self.stale_users.clear()
        for job_id in self.recently_preempted:
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
        )

    def _pass(self, now: float, trigger: str) -> None:
        state = self._state(now)
        t0 = time.perf_counter()
        decisions = self.decide(state)
        self.result.decide_ms.append((time.perf_counter() - t0) * 1000.0)
        self.result.passes += 1
        self.result.passes_by_trigger[trigger] += 1
        acted = False
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
        self.dirty = acted
        if self.opts.check:
            self._check()

    # ------------------------------------------------------------------ invariants

    def _check(self) -> None:
        held = 0
        for job in self.running.values():
            for g in job.gpu_ids:
                if self.owner.get(g) != job.id:
                    raise InvariantError(f"GPU {g} of job {job.id} not owned by it")
            held += len(job.gpu_ids)
        if held != len(self.owner):
            raise InvariantError(
                f"{len(self.owner)} GPUs allocated but running jobs hold {held}"
            )
        if len(self.owner) > self.total_gpus:
            raise InvariantError("more GPUs allocated than exist")

    def _final_checks(self) -> None:
        done = [j for j in self.jobs if j.state == "done"]
        if len(done) != self.finished:
            raise InvariantError("a job finished more than once or not recorded")
        for job in done:
            expected = (
                job.run_duration if job.outcome == "completed" else job.time_limit
            )
            final_run = job.end - job.started_at
            if abs(final_run - expected) > 1e-6 * max(1.0, expected):
                raise InvariantError(
                    f"job {job.id}: ran {final_run} s in its last attempt, "
                    f"its true duration (or limit) is {expected} s"
                )
