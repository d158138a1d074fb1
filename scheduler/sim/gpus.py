"""GPU occupancy and progress: who holds each GPU and how many slots, busy and
shared GPU time, usage charged (1/n on a GPU shared by n), and each job's
progress rate beside its partners (its end re-scheduled at every change)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from scheduler.sim.cluster import END, SimCluster
from scheduler.sim.colocation import Segment
from scheduler.sim.results import CLASSES, InvariantError

if TYPE_CHECKING:
    from collections.abc import Collection

    from scheduler.policy import GpuView
    from scheduler.sim.jobs import SimJob


class GpuPhysics(SimCluster):
    def _solo_key(self, job: SimJob) -> tuple[str, str]:
        return job.label, self.gpu_model[job.gpu_ids[0]].lower()

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
            if partners:
                self._mark_episode(job.segment, job, partners)
        self.stale_views.add(job.id)
        # its end at this rate, or its (wall-clock) limit if that comes first
        left = max(job.run_duration - job.done_work, 0.0)
        t_done = now + left / rate
        t_limit = job.started_at + job.attempt_limit
        job.epoch += 1
        if t_done <= t_limit:
            job.end_cause = "completed"
            self._push(t_done, END, job.id, job.epoch)
        else:
            job.end_cause = "timeout"
            self._push(t_limit, END, job.id, job.epoch)

    def _mark_episode(
        self, seg: Segment, job: SimJob, partners: tuple[int, ...]
    ) -> None:
        """Whether the sharing episode ``seg`` begins is an exploration trial (the
        latest of its jobs to join was admitted as one), and its GPU's true
        combined normalised throughput (every job's rate, summed)."""
        group = [job, *(self.by_id[p] for p in partners)]
        joiners = [j for j in group if j.joined_at is not None]
        if joiners:
            seg.trial = max(joiners, key=lambda j: (j.joined_at or 0.0, j.id)).trial
        table = self.colocation
        model = self.gpu_model[job.gpu_ids[0]]
        combined = 0.0
        for m in group:
            r = 1.0
            for o in group:
                if o is not m and table is not None:
                    r *= table.norm(model, m.label, o.label) or 0.0
            combined += r
        seg.combined = combined

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
                if seg.trial:
                    self.result.trial_over_cap_s += length
            if seg.trial and seg.combined < 1.0:
                # the GPU's loss, shared among the episode's jobs (each closes
                # its own segment over the same stretch)
                share = (1.0 - seg.combined) / (len(seg.partners) + 1)
                self.result.trial_shared_loss_gpu_s += length * share
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
        self.checkpoint_due.pop(job.id, None)
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
