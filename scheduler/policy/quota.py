"""Quotas in the pass: GPU-hours per period and a cap on concurrent GPUs,
per group and per user, as plain data the loader computed (``QuotaView``).

A job is subject to its owner's user quota and to its group's quota (the group it
is charged to). For each pending job, before it is placed (the gate, ``stages.gate``):

- a **hard** quota whose GPU-hours for the period are used up (used >= limit), or
  **any** quota whose concurrent-GPU cap the job would pass (GPUs its jobs hold,
  counting the jobs started earlier in this pass, plus the job's own), keeps it
  PENDING with ``Reason.QUOTA`` ("quota exhausted: ..." naming the quota,
  used/limit and when it resets). Such a job is never started or backfilled, and
  never becomes the top blocked job: it holds no reservation and triggers no
  preemption, so it blocks nobody;
- a **soft** quota whose GPU-hours are used up lowers the job's priority: its
  fair-share factor is multiplied by ``PolicyConfig.quota_soft_factor`` (once,
  however many soft quotas of the job are over; see ``Quotas.fairshare_scale``).

Running jobs (``overruns``): with ``quota_overrun == "stop"``, a running job under
a hard quota whose GPU-hours are used up is stopped (``QuotaStop``: the kill path,
not requeued); with ``"finish"`` (the default) it runs to its end.

The simulator passes no quotas: every method is then a no-op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.policy.reasons import gpus_word, when
from scheduler.policy.state import QuotaStop

if TYPE_CHECKING:
    from collections.abc import Iterable

    from scheduler.policy.state import PendingJob, QuotaView, RunningJob


def _hours(x: float) -> str:
    """GPU-hours to one decimal; a small non-zero amount to three digits."""
    return f"{x:,.1f}" if x >= 1 or x == 0 else f"{x:.3g}"


class Quotas:
    """Per-pass quota book: which quotas each (group, user) is under, and the GPUs
    each quota's jobs hold, updated as the pass starts jobs."""

    def __init__(self, quotas: Iterable[QuotaView], soft_factor: float) -> None:
        self.quotas = tuple(quotas)
        self.soft_factor = soft_factor
        self._by_group: dict[str, list[QuotaView]] = {}
        self._by_user: dict[str, list[QuotaView]] = {}
        for q in self.quotas:
            if q.user:
                self._by_user.setdefault(q.user, []).append(q)
            else:
                self._by_group.setdefault(q.group, []).append(q)
        self.holding = {q.id: q.running_gpus for q in self.quotas}
        self._of: dict[tuple[str, str], tuple[QuotaView, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.quotas)

    def of(self, group: str, user: str) -> tuple[QuotaView, ...]:
        """The quotas a job of ``user`` charged to ``group`` is subject to: the
        user's first, then the group's."""
        key = (group, user)
        got = self._of.get(key)
        if got is None:
            got = self._of[key] = (
                *self._by_user.get(user, ()),
                *self._by_group.get(group, ()),
            )
        return got

    def refusal(self, job: PendingJob, now: float) -> str | None:
        """Why ``job`` may not start now under its quotas ("quota exhausted: ..."),
        or None. The GPU-hour limit first (it lasts until the reset)."""
        quotas = self.of(job.group, job.user)
        for q in quotas:
            if q.hard and q.exhausted:
                assert q.gpu_hours is not None
                return (
                    f"quota exhausted: {q.label} used {_hours(q.used_gpu_hours)} of"
                    f" its {_hours(q.gpu_hours)} GPU-hours this {q.period} (hard"
                    f" limit); it resets at {when(q.resets_at, now)}"
                )
        for q in quotas:
            if q.max_gpus is not None and self.holding[q.id] + job.gpus > q.max_gpus:
                return (
                    f"quota exhausted: {q.label} may hold at most"
                    f" {gpus_word(q.max_gpus)} at once; its jobs hold"
                    f" {self.holding[q.id]} now and this job needs {job.gpus}; it"
                    " waits for some of them to end"
                )
        return None

    def take(self, job: PendingJob) -> None:
        """``job`` starts in this pass: its GPUs count against its quotas' caps."""
        for q in self.of(job.group, job.user):
            self.holding[q.id] += job.gpus

    def fairshare_scale(self, group: str, user: str) -> float:
        """The fair-share multiplier of a job of (group, user): ``soft_factor``
        when any soft quota of it has its GPU-hours used up, else 1."""
        if any(not q.hard and q.exhausted for q in self.of(group, user)):
            return self.soft_factor
        return 1.0

    def overruns(self, running: Iterable[RunningJob]) -> list[QuotaStop]:
        """The running jobs to stop (``quota_overrun == "stop"``): those under a
        hard quota whose GPU-hours are used up; a job already being stopped is
        left alone."""
        out = []
        for r in running:
            if r.stopping:
                continue
            for q in self.of(r.group, r.user):
                if q.hard and q.exhausted:
                    assert q.gpu_hours is not None
                    out.append(
                        QuotaStop(
                            r.id,
                            q.id,
                            f"stopped: {q.label} used {_hours(q.used_gpu_hours)} of"
                            f" its {_hours(q.gpu_hours)} GPU-hours this {q.period}"
                            " (hard limit; GPULAB_QUOTA_OVERRUN=stop)",
                        )
                    )
                    break
        return out
