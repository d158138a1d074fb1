"""The replay: a virtual clock, an event heap, and the policy's pass
(``policy.run_pass``) at the same triggers as production (arrivals, completions,
periodic); starts, ends, preemptions, evictions and OOM failures applied.

The modules beside it: ``cluster`` (the state and the event heap), ``gpus`` (GPU
occupancy, progress rates, usage), ``views`` (the ``ClusterState`` the policy sees,
built like the Celery pass builds it: true durations stay in the physics),
``results`` (options and the recorded result), ``usage`` (decayed usage). A
preempted job is requeued with its original submit time; it restarts from scratch
(no checkpoint credit) unless it is checkpointable: then it keeps its work up to its
last checkpoint (``SimOptions.checkpoint_interval_s`` of progress apart, or the
job's own ``checkpoint_interval_s``; 0: all of it) and its next attempt pays ``restart_overhead_s`` before it progresses.

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
import time
from collections import deque
from typing import TYPE_CHECKING

from scheduler.policy import Evict, Preempt, Start, Wait
from scheduler.sim.cluster import ARRIVAL, END, OOM_FAIL, PERIODIC, PREEMPT_DONE
from scheduler.sim.results import (
    CLASSES,
    InvariantError,
    PolicyContractError,
    SimOptions,
    SimResult,
)
from scheduler.sim.trace import throughput
from scheduler.sim.usage import DecayedUsage
from scheduler.sim.views import PolicyViews

if TYPE_CHECKING:
    from scheduler.policy.colocate import Admission
    from scheduler.sim.jobs import SimJob

SLIP_TOLERANCE_S = 60.0

__all__ = [
    "CLASSES",
    "DecayedUsage",
    "InvariantError",
    "PolicyContractError",
    "SimOptions",
    "SimResult",
    "Simulator",
]


class Simulator(PolicyViews):
    """Replays ``jobs`` on ``nodes`` under ``config`` (``SimCluster`` builds the
    state) and returns the ``SimResult``."""

    # ------------------------------------------------------------------ events

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
                    self._arrive(job, now)
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
                # a running job's new progress report changes its planned end
                if self.dirty or self.tracker.moved(self.running.values(), now):
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

    # ------------------------------------------------------------------ starts, ends

    def _arrive(self, job: SimJob, now: float) -> None:
        job.state = "pending"
        job.queued_at = now
        self._enqueue(job)

    def _enqueue(self, job: SimJob) -> None:
        self.pending[job.id] = job
        self.pending_by_user.setdefault(job.user, set()).add(job.id)
        self.pending_by_request.setdefault(self._request(job), set()).add(job.id)
        self.pending_views[job.id] = self._pending_view(job)
        if job.preempt_times:
            self.preempted_pending.add(job.id)

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
        self.preempted_pending.discard(job.id)
        self.pending_by_user[job.user].discard(job.id)
        self.pending_by_request[self._request(job)].discard(job.id)
        job.state = "running"
        job.attempt += 1
        job.started_at = now
        job.gpu_ids = gpu_ids
        if job.first_start is None:
            job.first_start = now
            if job.first_est is not None and now > job.first_est + SLIP_TOLERANCE_S:
                self.result.slipped += 1
        job.run_duration = self._true_duration(job, start)
        job.overhead_s = 0.0
        job.attempt_limit = job.time_limit
        if job.done_fraction > 0:
            # resumed from a checkpoint: what is left of the work, after a restart
            job.overhead_s = self.opts.restart_overhead_s
            job.run_duration = (
                job.run_duration * (1.0 - job.done_fraction) + job.overhead_s
            )
            job.attempt_limit = (
                max(job.time_limit - job.limit_used_s, 0.0) + job.overhead_s
            )
            job.resumes += 1
            self.result.resumes += 1
            self.result.overhead_gpu_s += job.overhead_s * job.gpus
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
        job.guest = start.guest
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
        self.tracker.started(job, now)
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
        self.tracker.ended(job, now)
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
            self.pools_changed.update(self.pools.add(self._request(job), ran))
            self.user_version[job.user] = self.user_version.get(job.user, 0) + 1
            self.stale_users.add(job.user)

    def _preempt(self, decision: Preempt, now: float) -> None:
        job = self.by_id.get(decision.victim_id)
        view = self.running_views.get(decision.victim_id)
        if job is None or view is None or job.state != "running":
            raise PolicyContractError(
                f"Preempt of job {decision.victim_id}, which is not running"
            )
        if not (view.preemptible or view.checkpointable):
            raise PolicyContractError(
                f"Preempt of job {job.id}, which is neither preemptible nor"
                " checkpointable"
            )
        job.state = "stopping"
        job.preemptions += 1
        job.preempt_times.append(now)
        self.result.preemptions += 1
        self.running_views[job.id] = self._running_view(job, now)
        self._push(now + self.opts.preempt_grace_s, PREEMPT_DONE, job.id, job.attempt)

    def _back_to_queue(self, job: SimJob, ran: float, now: float) -> None:
        """Requeue after a stopped attempt: original submit time (age kept); its
        pending END and OOM events go stale."""
        job.run_total += ran
        job.last_run_s = ran
        job.queued_at = now
        job.attempt += 1
        job.epoch += 1
        job.doomed = False
        job.state = "pending"
        job.gpu_ids = ()
        self._enqueue(job)

    def _requeue(self, job: SimJob, now: float) -> None:
        """A preempted job's stop is done: it goes back to the queue, keeping the
        work up to its last checkpoint when it is checkpointable."""
        ran = self._release(job, now)
        kept = self._checkpointed(job) if job.checkpointable else 0.0
        self.result.lost_gpu_s += (ran - kept) * job.gpus
        self.result.overhead_in_lost_gpu_s += min(ran, job.overhead_s) * job.gpus
        self.result.kept_gpu_s += kept * job.gpus
        self._back_to_queue(job, ran, now)

    def _checkpointed(self, job: SimJob) -> float:
        """Seconds of this attempt's progress saved by its last checkpoint (one
        per ``checkpoint_interval_s`` of progress after the restart overhead);
        ``done_fraction`` grows by their share of the attempt's work."""
        work = job.run_duration - job.overhead_s  # this attempt's share of the job
        useful = min(max(job.done_work - job.overhead_s, 0.0), work)
        every = (
            self.opts.checkpoint_interval_s
            if job.checkpoint_interval_s is None
            else job.checkpoint_interval_s
        )
        saved = useful if every <= 0 else (useful // every) * every
        if saved > 0 and work > 0:
            job.limit_used_s += saved
            left = 1.0 - job.done_fraction
            job.done_fraction = min(1.0, job.done_fraction + left * saved / work)
        return saved

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
        trial = job.segment is not None and job.segment.trial
        ran = self._release(job, now)
        self.result.requeues += 1
        self.result.evictions += 1
        self.result.evicted_work_s += job.done_work
        if trial:
            self.result.trial_lost_gpu_s += job.done_work
        if self.meter is not None and decision.harmful:
            self.meter.refuse(job.label, partner.label)
        self._back_to_queue(job, ran, now)

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
        if job.trial:
            self.result.trial_lost_gpu_s += ran
        if self.meter is not None:
            for p in beside:
                self.meter.refuse(job.label, self.by_id[p].label)
        self._back_to_queue(job, ran, now)

    # ------------------------------------------------------------------ the pass

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
                    if d.est_start is not None:
                        self.tracker.shown_start(job, now, d.est_start)
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
        self.tracker.observe(self.running.values())  # rates the decisions set
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
                expected = job.attempt_limit
            elif not job.shared_attempt:
                expected = job.progress_from - job.started_at + job.run_duration
            else:
                continue  # its work was checked at its end (``_end``)
            if abs(final_run - expected) > 1e-6 * max(1.0, expected):
                raise InvariantError(
                    f"job {job.id}: ran {final_run} s in its last attempt, "
                    f"its true duration (or limit) is {expected} s"
                )
