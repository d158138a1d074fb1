"""What the policy sees: the ``ClusterState`` of a pass, built like the Celery
pass builds it (requests, labels, limits, run times predicted from the jobs
finished so far, decayed usage, what was learned about pairs); true durations
stay in the physics."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from scheduler.policy import ClusterState, PendingJob, RunningJob, Usage
from scheduler.policy.interference import Knowledge
from scheduler.policy.predict import (
    PoolKey,
    Request,
    deciding_keys,
    planned_runtime,
    predict,
)
from scheduler.sim.gpus import GpuPhysics
from scheduler.sim.results import CLASSES

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scheduler.sim.jobs import SimJob

TRIAL_WINDOW_S = 3600.0  # ClusterState.trials_last_hour


class PolicyViews(GpuPhysics):
    # the prediction ``_repredict_pools`` just made for the request whose views it
    # renews, so ``_predict`` does not make it again for each of its jobs
    _known_prediction: tuple[Request, tuple[float | None, str]] | None = None

    @staticmethod
    def _request(job: SimJob) -> Request:
        """What keys ``job``'s pools (``policy.predict.Request``)."""
        return Request(job.user, job.label, job.gpus, job.time_limit)

    def _predict(self, job: SimJob) -> tuple[float | None, str]:
        """The production rule: under ``prediction = "pools"``,
        ``policy.predict.predict_pools`` over the pools' completed runs; else
        ``policy.predict.predict`` over the user's completed runs with the same
        label, else over all of the user's."""
        if self.config.prediction == "pools":
            req = self._request(job)
            known = self._known_prediction
            got = known[1] if known is not None and known[0] == req else None
            if got is None:
                got = self.pools.predict(req)
            self.request_prediction[req] = got
            self._watch(req, deciding_keys(req, got[1]))
            return got
        if job.label:
            hist = self.hist_label.get((job.user, job.label))
            if hist:
                return predict(hist), "user+label"
        hist_u = self.hist_user.get(job.user)
        if hist_u:
            return predict(hist_u), "user"
        return None, "default"

    def _watch(self, req: Request, keys: tuple[PoolKey, ...]) -> None:
        """Notes that a run added to a pool of ``keys`` may change ``req``'s
        prediction (none: ``req`` has no waiting job left to predict)."""
        old = self.request_watching.get(req, ())
        if old == keys:
            return
        for key in old:
            if key not in keys:
                self.pool_watchers[key].discard(req)
        for key in keys:
            self.pool_watchers.setdefault(key, set()).add(req)
        if keys:
            self.request_watching[req] = keys
        else:
            self.request_watching.pop(req, None)

    def _repredict_pools(self) -> None:
        """``--prediction pools``: the waiting jobs whose prediction the runs
        completed since the last pass changed get a new view. Only requests
        watching a pool that gained a run can change (``_watch``); the others
        keep the prediction they have."""
        changed = self.pools_changed
        if not changed:
            return
        self.pools_changed = set()
        stale: set[Request] = set()
        for key in changed:
            stale.update(self.pool_watchers.get(key, ()))
        for req in stale:
            ids = self.pending_by_request.get(req)
            if not ids:
                self._watch(req, ())
                continue
            got = self.pools.predict(req)
            if got == self.request_prediction.get(req):
                continue
            self._known_prediction = (req, got)
            try:
                for job_id in ids:
                    self.pending_views[job_id] = self._pending_view(
                        self.pending[job_id]
                    )
            finally:
                self._known_prediction = None

    def _oracle_left(self, job: SimJob) -> float:
        """``--oracle-runtime``: the true run time a waiting job has left (its
        reference duration less the work its checkpoints kept, plus the restart
        overhead a resumed attempt pays)."""
        left = job.ref_duration * (1.0 - job.done_fraction)
        if job.done_fraction > 0:
            left += self.opts.restart_overhead_s
        return left

    def _oracle_end(self, job: SimJob) -> float:
        """``--oracle-runtime``: when a running job truly ends, at its current
        rate (its limit if that comes first)."""
        left = max(job.run_duration - job.done_work, 0.0)
        done = job.rate_since + left / job.rate if job.rate > 0 else math.inf
        return min(done, job.started_at + job.attempt_limit)

    def _checkpoint_at(self, job: SimJob, now: float) -> float | None:
        """When ``job``'s current attempt last checkpointed (one checkpoint per
        checkpoint interval of progress after its restart overhead, as
        ``engine._checkpointed`` counts them; None: none yet), for
        ``RunningJob.checkpoint_at``; notes when its next one falls
        (``checkpoint_due``). A checkpoint before the job's latest change of rate
        is placed as if it had run alone since its start."""
        self.checkpoint_due.pop(job.id, None)
        if not job.checkpointable or job.state != "running":
            return None
        every = (
            self.opts.checkpoint_interval_s
            if job.checkpoint_interval_s is None
            else job.checkpoint_interval_s
        )
        rate = job.rate
        work = job.done_work + rate * (now - job.rate_since)
        useful = work - job.overhead_s
        if every <= 0:
            return now if useful > 0 else None
        k = math.floor(useful / every) if useful > 0 else 0
        if rate > 0:
            nxt = job.overhead_s + (k + 1) * every
            self.checkpoint_due[job.id] = job.rate_since + (nxt - job.done_work) / rate
        if k <= 0:
            return None
        target = job.overhead_s + k * every  # the attempt's work at that checkpoint
        if target >= job.done_work and rate > 0:
            return job.rate_since + (target - job.done_work) / rate
        return min(job.rate_since, job.started_at + target)

    def _pending_view(self, job: SimJob) -> PendingJob:
        predicted: float | None
        if self.opts.oracle_runtime:
            predicted, source = self._oracle_left(job), "oracle"
        else:
            predicted, source = self._predict(job)
        job.planned_s = planned_runtime(job.time_limit, predicted)
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
            attained_gpu_s=job.gpus * job.run_total,
            checkpointable=job.checkpointable,
            preempted_at=job.last_preempted_at,
        )

    def _running_view(self, job: SimJob, now: float) -> RunningJob:
        recent = _recent(job.preempt_times, now)
        cls = CLASSES[job.priority_class]
        measured: float | None = None
        measured_for = 0.0
        seg = job.segment
        if seg is not None and seg.partners and self.meter is not None:
            log_r = self.meter.log_slowdown(seg, self._solo_key(job))
            if log_r is not None:
                measured = math.exp(log_r)
                measured_for = seg.measured_s
        planned_s = job.planned_s
        progress = self.tracker.view(job, now)
        if self.opts.oracle_runtime:
            planned_s = self._oracle_end(job) - job.started_at
            progress = None
        return RunningJob(
            id=job.id,
            gpu_ids=job.gpu_ids,
            started_at=job.started_at,
            planned_s=planned_s,
            time_limit_s=job.attempt_limit,
            user=job.user,
            group=job.group,
            priority_class=job.priority_class,
            preemptible=(
                cls.preemptible
                or self.opts.preempt_any
                or (self.opts.preempt_checkpointable and job.checkpointable)
            )
            and job.state == "running",
            preemptions_last_hour=recent,
            stopping=job.state == "stopping",
            shareable=job.shareable,
            workload=job.label,
            gpu_memory_mib=job.gpu_mem_mib,
            peak_memory_mib=job.gpu_mem_mib,  # the sim's jobs use what they declare
            slowdown_cap=cls.slowdown_cap,
            joined_at=job.joined_at,
            trial=job.trial,
            measured_slowdown=measured,
            measured_for_s=measured_for,
            progress=progress,
            checkpointable=job.checkpointable,
            prior_gpu_s=job.gpus * job.run_total,
            submitted_at=job.submit,
            checkpoint_at=(
                self._checkpoint_at(job, now)
                if self.config.las_victims == "checkpoint"
                else None
            ),
            guest=job.guest,
            preempted_at=job.last_preempted_at,
        )

    def _state(self, now: float) -> ClusterState:
        if self.config.prediction == "pools":
            self._repredict_pools()
        else:
            for user in self.stale_users:
                version = self.user_version.get(user, 0)
                for job_id in self.pending_by_user.get(user, ()):
                    job = self.pending[job_id]
                    if job.pred_version != version:
                        self.pending_views[job_id] = self._pending_view(job)
        self.stale_users.clear()
        # the waiting jobs preempted within the hour: their count as of now
        for job_id in list(self.preempted_pending):
            n = _recent(self.pending[job_id].preempt_times, now)
            view = self.pending_views[job_id]
            if view.preemptions_last_hour != n:
                self.pending_views[job_id] = replace(view, preemptions_last_hour=n)
            if n == 0:
                self.preempted_pending.discard(job_id)
        refresh = self.recently_preempted | self.stale_views
        self.stale_views.clear()
        # progress: rates the events changed, and the jobs that reported since
        self.tracker.observe(self.running.values())
        refresh |= self.tracker.due(self.running.values(), now)
        if self.checkpoint_due:
            refresh |= {j for j, t in self.checkpoint_due.items() if t <= now}
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


def _recent(preempt_times: list[float], now: float) -> int:
    """Preemptions in the hour before ``now`` (``preempt_max_per_hour``)."""
    return sum(1 for t in preempt_times if now - t < 3600.0)
