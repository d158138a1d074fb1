"""``tiresias``: a simulator-only reference policy after Gu et al., "Tiresias: A GPU
Cluster Manager for Distributed Deep Learning" (NSDI 2019): discretised
two-dimensional least attained service (2D-LAS). Never a production policy.

- A job's attained service is GPUs x seconds run, over all its attempts (the
  simulator's record, ``Service``; the work a preemption throws away counts too: it
  was service received).
- Two queues (the paper's K = 2): a job is in the top queue (0) while its service
  since its last promotion is under ``threshold_gpu_s``, else in queue 1. Within a
  queue, jobs are served first come first served by arrival (submit time, then id).
- Starvation (the paper's STARVELIMIT): a pending job of queue 1 that has waited
  since its last stop longer than ``starve_limit`` x the length of its last run is
  promoted back to queue 0, and its service is counted afresh from there (so it
  keeps the top queue for one threshold's worth of service, then is demoted again).
- A pass places the pending jobs in queue order on the free GPUs with the same
  placement as gpulab (``policy.place``: best fit on one node, the closest GPUs
  by topology, a gang on the fewest nodes), skipping what does not fit (the paper
  is work-conserving: no reservation).
- A top-queue job that still waits preempts running jobs of queue 1, the last in
  queue order first, as few as its placement needs (GPUs of jobs already being
  stopped (``RunningJob.stopping``) count as coming free, so a job does not
  preempt twice for one start).
  What a preemption costs (the work since the victim's last checkpoint, a restart
  overhead) is the simulator's (``SimOptions.checkpoint_interval_s``,
  ``restart_overhead_s``, ``SimJob.checkpointable``), not this module's.

Pure: no Django, no I/O, no clock. The only state kept between passes is each
promoted job's service at its promotion (``Tiresias.base``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.policy import (
    Decision,
    PassResult,
    PassStats,
    PendingJob,
    Preempt,
    Reason,
    RunningJob,
    Start,
    Wait,
    dependency,
    index,
    place,
)
from scheduler.policy.ledger import Ledger
from scheduler.policy.reasons import Messages
from scheduler.policy.state import (
    STAGE_ORDERING,
    STAGE_PLACEMENT,
    STAGE_RESERVATION,
    is_interactive,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from scheduler.policy import ClusterState, GpuView
    from scheduler.sim.jobs import SimJob

NAME = "tiresias"
# Queue threshold chosen by bench/tiresias_sweep.py on scenario (b) (docs/policy.md).
DEFAULT_THRESHOLD_GPU_H = 16.0
DEFAULT_STARVE_LIMIT = 8.0


@dataclass(frozen=True)
class TiresiasParams:
    threshold_gpu_s: float = DEFAULT_THRESHOLD_GPU_H * 3600.0
    starve_limit: float = DEFAULT_STARVE_LIMIT  # x the last run's length


@dataclass(frozen=True)
class Service:
    """What the policy knows of a job's past runs."""

    attained_gpu_s: float  # GPUs x seconds run, all attempts (the current one too)
    last_run_s: float  # its last stopped attempt's length (0: never stopped)
    queued_since: float  # when it last became pending
    submitted_at: float = 0.0  # its arrival
    running: bool = False  # it holds GPUs (running, or being stopped)


def sim_service(jobs: Mapping[int, SimJob]) -> Callable[[int, float], Service]:
    """A job's ``Service`` at ``now`` from the simulator's record of it."""

    def service(job_id: int, now: float) -> Service:
        job = jobs[job_id]
        ran = job.run_total
        if job.state in ("running", "stopping"):
            ran += now - job.started_at
        return Service(
            attained_gpu_s=job.gpus * ran,
            last_run_s=job.last_run_s,
            queued_since=job.queued_at,
            submitted_at=job.submit,
            running=job.state in ("running", "stopping"),
        )

    return service


class Tiresias:
    """The pass (``run``) and the promotions it remembers."""

    def __init__(
        self, params: TiresiasParams, service: Callable[[int, float], Service]
    ) -> None:
        if params.threshold_gpu_s <= 0 or params.starve_limit <= 0:
            raise ValueError("tiresias: threshold and starve limit must be > 0")
        self.params = params
        self.service = service
        # job -> (its service, the time) at its last promotion
        self.base: dict[int, tuple[float, float]] = {}
        self.promotions = 0

    def rank(
        self, job_id: int, gpus: int, svc: Service, now: float
    ) -> tuple[int, float]:
        """(queue, when the job entered it): the queue order. A job enters queue 0
        at its arrival or at its last promotion, and queue 1 when its service since
        then crossed the threshold (it crosses while running, at ``gpus`` GPU-s
        per second: for a running job back from now, else from its last stop)."""
        base_s, promoted_at = self.base.get(job_id, (0.0, svc.submitted_at))
        over = svc.attained_gpu_s - base_s - self.params.threshold_gpu_s
        if over < 0:
            return 0, promoted_at
        last = now if svc.running else svc.queued_since
        return 1, last - over / max(gpus, 1)

    def queue_of(self, job_id: int, svc: Service, now: float) -> int:
        """The queue ``job_id`` is in (0: top), without promoting it."""
        return self.rank(job_id, 1, svc, now)[0]

    def _pending_rank(self, job: PendingJob, now: float) -> tuple[int, float]:
        """``rank``, after promoting a queue-1 job that has waited since its last
        stop longer than ``starve_limit`` x that last run (its service counts
        afresh from here, and it joins the end of queue 0)."""
        svc = self.service(job.id, now)
        got = self.rank(job.id, job.gpus, svc, now)
        if (
            got[0] > 0
            and svc.last_run_s > 0
            and now - svc.queued_since > self.params.starve_limit * svc.last_run_s
        ):
            self.base[job.id] = (svc.attained_gpu_s, now)
            self.promotions += 1
            got = (0, now)
        return got

    def run(self, state: ClusterState) -> PassResult:
        t0 = time.perf_counter()
        now = state.now
        live = {j.id for j in state.pending} | {r.id for r in state.running}
        if len(self.base) > 2 * len(live) + 64:
            self.base = {k: v for k, v in self.base.items() if k in live}
        pending = sorted((*self._pending_rank(j, now), j.id, j) for j in state.pending)
        running_svc = {r.id: self.service(r.id, now) for r in state.running}
        running_rank = {
            r.id: self.rank(r.id, len(r.gpu_ids), running_svc[r.id], now)
            for r in state.running
        }
        t1 = time.perf_counter()
        idx = index.build(state, predictions=False)
        ledger = Ledger({n: gs.copy() for n, gs in idx.free_now.items()}, idx.node_rank)
        messages = Messages(idx)
        decisions: list[Decision] = []
        waiting: list[tuple[int, PendingJob, index.Constraint, int]] = []
        position = 0
        started = 0
        for q, _, _, job in pending:
            c = idx.constraint(job)
            position += 1
            gated = dependency.refusal(job)
            if gated is None and not place.could_ever(idx, c, job.gpus):
                gated = (Reason.NO_SUCH_SHAPE, messages.no_such_shape(c, job.gpus))
            if gated is not None:
                decisions.append(Wait(job.id, gated[0], gated[1], position))
                continue
            got = place.place(ledger, idx, c, job.gpus, topology=True)
            if got is not None:
                place.take(ledger, got)
                decisions.append(Start(job.id, got))
                started += 1
                continue
            waiting.append((q, job, c, position))
        t2 = time.perf_counter()
        stopping = {r.id for r in state.running if r.stopping}
        preempted, for_job = self._preempt(
            state, idx, ledger, waiting, running_rank, stopping
        )
        for q, job, c, pos in waiting:
            if job.id in for_job:
                text = f"waiting for {for_job[job.id]} preempted job(s) to stop"
                decisions.append(Wait(job.id, Reason.WAITING_FOR_PREEMPTION, text, pos))
            else:
                text = f"queue {q}: " + messages.resources(c, job.gpus, ledger)
                decisions.append(Wait(job.id, Reason.RESOURCES, text, pos))
        decisions.extend(preempted)
        stage_s = {
            STAGE_ORDERING: t1 - t0,
            STAGE_PLACEMENT: t2 - t1,
            STAGE_RESERVATION: time.perf_counter() - t2,
        }
        return PassResult(
            decisions,
            PassStats(
                considered=len(pending),
                started=started,
                preempted=len(preempted),
                stage_s=stage_s,
            ),
        )

    def _preempt(
        self,
        state: ClusterState,
        idx: index.PassIndex,
        ledger: Ledger,
        waiting: list[tuple[int, PendingJob, index.Constraint, int]],
        running_rank: Mapping[int, tuple[int, float]],
        stopping: set[int],
    ) -> tuple[list[Preempt], dict[int, int]]:
        """Victims for the waiting top-queue jobs, in queue order: the running
        jobs of queue 1, the last in queue order first, as few as the placement
        needs. The plan starts from the free GPUs left after this pass's starts
        plus those of jobs being stopped; what a job is planned on is taken."""
        top = [w for w in waiting if w[0] == 0]
        if not top:
            return [], {}
        plan = ledger.copy()
        for r in state.running:
            if r.id in stopping:
                _give(plan, idx, r.gpu_ids)
        victims = sorted(
            (
                r
                for r in state.running
                if r.preemptible
                and r.id not in stopping
                and running_rank[r.id][0] > 0
                and not is_interactive(state, r)
            ),
            key=lambda r: (running_rank[r.id], r.id),
            reverse=True,
        )
        chosen: list[Preempt] = []
        for_job: dict[int, int] = {}
        for _, job, c, _ in top:
            got = place.place(plan, idx, c, job.gpus, topology=True)
            if got is not None:
                place.take(plan, got)  # it starts once the stops are done
                continue
            trial = plan.copy()
            used: list[RunningJob] = []
            for v in victims:
                _give(trial, idx, v.gpu_ids)
                used.append(v)
                got = place.place(trial, idx, c, job.gpus, topology=True)
                if got is not None:
                    break
            if got is None:
                continue  # even every queue-1 job would not make room
            # drop the victims the placement does not need, newest kept last
            for v in list(reversed(used[:-1])):
                less = plan.copy()
                for u in used:
                    if u is not v:
                        _give(less, idx, u.gpu_ids)
                again = place.place(less, idx, c, job.gpus, topology=True)
                if again is not None:
                    used.remove(v)
                    got = again
            for v in used:
                _give(plan, idx, v.gpu_ids)
                victims.remove(v)
                chosen.append(
                    Preempt(
                        v.id, job.id, f"tiresias: job {job.id} is in a higher queue"
                    )
                )
            place.take(plan, got)
            for_job[job.id] = len(used)
        return chosen, for_job


def _give(ledger: Ledger, idx: index.PassIndex, gpu_ids: tuple[int, ...]) -> None:
    by_node: dict[int, list[GpuView]] = {}
    for g in gpu_ids:
        view = idx.gpu_by_id[g]
        if view.schedulable and view.node_id in idx.schedulable_nodes:
            by_node.setdefault(view.node_id, []).append(view)
    for node_id, gpus in by_node.items():
        ledger.give(node_id, gpus)


def runner(params: TiresiasParams, jobs: Mapping[int, SimJob]) -> Tiresias:
    """The policy over the simulator's jobs (their attained service)."""
    return Tiresias(params, sim_service(jobs))


__all__ = [
    "DEFAULT_STARVE_LIMIT",
    "DEFAULT_THRESHOLD_GPU_H",
    "NAME",
    "Service",
    "Tiresias",
    "TiresiasParams",
    "runner",
    "sim_service",
]
