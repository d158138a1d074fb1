"""Find idle jobs: one query over recent samples for every running attempt.

What counts as idle evidence in one sample is ``portal.idle.evidence`` (the one
definition, shared with the admin overview's idle GPU-hours): the SM utilisation
of the attempt's own processes below its class's threshold, memory held counting
for nothing; a lost GPU, an unknown reading or a gap between samples longer than
``evidence.max_gap()`` is no evidence, and the idle run starts again after it. A
job is idle when, on every GPU it holds, the current run of idle evidence is at
least the window long and its latest sample is fresh; so a job younger than the
window never is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from portal.idle import activity, evidence
from portal.idle.models import IdleFlag
from portal.idle.rules import IdleRule, all_rules, rule_for
from portal.notifications.models import Kind
from portal.notifications.services import notify
from scheduler import services
from scheduler.models import Job, JobEvent
from scheduler.services.common import _event

log = logging.getLogger(__name__)

# Key of the advisory lock that makes the check single-flight.
IDLE_LOCK_KEY = 0x6770_7532  # "gpu2"

_QUERY = """
WITH rules(name, threshold) AS (
    SELECT * FROM unnest(%(names)s::text[], %(thresholds)s::float8[])
),
live AS (
    SELECT DISTINCT t.id AS attempt_id, t.job_id, t.started_at, j.priority_class,
           a.gpu_id, coalesce(r.threshold, %(default_threshold)s) AS threshold
    FROM scheduler_attempt t
    JOIN scheduler_job j ON j.id = t.job_id
    JOIN scheduler_allocation a ON a.attempt_id = t.id AND a.released_at IS NULL
    LEFT JOIN rules r ON r.name = j.priority_class
    WHERE t.ended_at IS NULL AND t.started_at IS NOT NULL AND j.status = 'running'
      AND j.cancel_requested_at IS NULL
),
readings AS (
    SELECT l.attempt_id, l.gpu_id, s.at, l.threshold,
        OWN_SM AS own_util,
        OWN_MEMORY AS own_mem,
        s.at - lag(s.at) OVER (PARTITION BY l.attempt_id, l.gpu_id ORDER BY s.at)
            AS gap
    FROM live l
    JOIN scheduler_gpusample s ON s.gpu_id = l.gpu_id
        AND s.at >= greatest(l.started_at, %(since)s) AND s.at <= %(now)s
),
marked AS (
    SELECT *, coalesce(own_util >= threshold, false) AS active,
           (own_util IS NULL OR own_util >= threshold) AS breaks,
           coalesce(gap > %(max_gap)s, false) AS resumes
    FROM readings
),
edges AS (
    SELECT attempt_id, gpu_id, max(at) AS last_at,
           max(at) FILTER (WHERE active) AS last_active_at,
           max(at) FILTER (WHERE breaks) AS last_break_at,
           max(at) FILTER (WHERE resumes) AS last_resume_at
    FROM marked GROUP BY 1, 2
)
SELECT l.attempt_id, l.job_id, l.started_at, l.priority_class, l.gpu_id,
       e.last_at, e.last_active_at, min(m.at) AS run_start,
       max(m.own_util) AS util_max, avg(m.own_util) AS util_mean,
       max(m.own_mem) AS mem_max
FROM live l
LEFT JOIN edges e ON e.attempt_id = l.attempt_id AND e.gpu_id = l.gpu_id
LEFT JOIN marked m ON m.attempt_id = l.attempt_id AND m.gpu_id = l.gpu_id
    AND m.at > coalesce(e.last_break_at, '-infinity'::timestamptz)
    AND m.at >= coalesce(e.last_resume_at, '-infinity'::timestamptz)
GROUP BY l.attempt_id, l.job_id, l.started_at, l.priority_class, l.gpu_id,
         e.last_at, e.last_active_at
""".replace("OWN_SM", evidence.own_sm("s", "l.attempt_id")).replace(
    "OWN_MEMORY", evidence.own_memory("s", "l.attempt_id")
)


@dataclass
class GpuReading:
    gpu_id: int
    last_at: datetime | None
    last_active_at: datetime | None
    run_start: datetime | None
    util_max: float | None
    util_mean: float | None
    mem_max: int | None


@dataclass
class AttemptReading:
    attempt_id: int
    job_id: int
    started_at: datetime
    priority_class: str
    gpus: list[GpuReading] = field(default_factory=list)
    # A person's last use through the portal (``portal.idle.activity``).
    used_at: datetime | None = None

    def idle_since(
        self, rule: IdleRule, now: datetime, max_gap: timedelta
    ) -> datetime | None:
        """When the current idle run began on all its GPUs, if it is idle now."""
        start = now - timedelta(seconds=rule.window_s)
        if self.started_at > start or not self.gpus:
            return None  # younger than the window
        runs = []
        for g in self.gpus:
            if g.run_start is None or g.last_at is None or g.last_at < now - max_gap:
                return None  # no (fresh) evidence on this GPU
            if g.run_start > start:
                return None
            runs.append(g.run_start)
        if self.used_at is not None:
            if self.used_at > start:
                return None  # used within the window
            runs.append(self.used_at)
        return max(runs)

    def last_active_at(self) -> datetime | None:
        """The GPU's last active sample or the last use through the portal."""
        times = [g.last_active_at for g in self.gpus if g.last_active_at]
        if self.used_at is not None:
            times.append(self.used_at)
        return max(times) if times else None


max_gap = evidence.max_gap


def readings(now: datetime, rules: dict[str, IdleRule]) -> dict[int, AttemptReading]:
    """Every running attempt with its GPUs' idle evidence (one query)."""
    default = rule_for(rules, "")
    longest = max([r.window_s for r in rules.values()] + [default.window_s])
    gap = max_gap()
    params: dict[str, Any] = {
        "names": list(rules),
        "thresholds": [r.threshold for r in rules.values()],
        "default_threshold": default.threshold,
        "since": now - timedelta(seconds=longest) - 2 * gap,
        "now": now,
        "max_gap": gap,
    }
    out: dict[int, AttemptReading] = {}
    with connection.cursor() as cursor:
        cursor.execute(_QUERY, params)
        for row in cursor.fetchall():
            (attempt_id, job_id, started, cls, gpu_id, last_at, last_active, run,
             umax, umean, mem) = row  # fmt: skip
            reading = out.setdefault(
                attempt_id, AttemptReading(attempt_id, job_id, started, cls)
            )
            reading.gpus.append(
                GpuReading(
                    gpu_id, last_at, last_active, run,
                    None if umax is None else float(umax),
                    None if umean is None else float(umean),
                    None if mem is None else int(mem),
                )
            )  # fmt: skip
    used = activity.last_used([r.job_id for r in out.values()])
    for reading in out.values():
        reading.used_at = used.get(reading.job_id)
    return out


@dataclass
class CheckResult:
    flagged: list[int] = field(default_factory=list)
    cleared: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    ended: int = 0


def check(now: datetime | None = None) -> CheckResult:
    """One idle check (beat, every ``GPULAB_IDLE_CHECK_INTERVAL`` s): flag, clear
    and cancel. Single-flight (an advisory lock); each change is its own
    transaction with the job row locked."""
    now = now or timezone.now()
    result = CheckResult()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [IDLE_LOCK_KEY])
            if not cursor.fetchone()[0]:
                return result
        rules = all_rules()
        seen = readings(now, rules)
        flags = {
            f.attempt_id: f for f in IdleFlag.objects.filter(cleared_at__isnull=True)
        }
        # Flags of attempts no longer running close quietly (the job's own end
        # is in its history already).
        gone = [f.pk for a, f in flags.items() if a not in seen]
        result.ended = IdleFlag.objects.filter(pk__in=gone).update(
            cleared_at=now, cleared=IdleFlag.Cleared.ENDED
        )
        gap = max_gap()
        for attempt_id, reading in seen.items():
            rule = rule_for(rules, reading.priority_class)
            flag = flags.get(attempt_id)
            since = reading.idle_since(rule, now, gap)
            if flag is None:
                if since is not None and _flag(reading, rule, since, now):
                    result.flagged.append(reading.job_id)
                continue
            active = reading.last_active_at()
            # Strictly after: the idle run may begin at the last use through
            # the portal itself, which is no activity since.
            if active is not None and active > flag.since:
                _clear(flag, active, now)
                result.cleared.append(reading.job_id)
                continue
            if since is None:
                continue  # a gap, or not long enough since one: wait for evidence
            _refresh(flag, reading, now)
            due = flag.cancel_at is not None and now >= flag.cancel_at
            if due and _cancel(flag, now):
                result.cancelled.append(reading.job_id)
    if result.flagged or result.cleared or result.cancelled:
        log.info("idle check: %s", result)
    return result


def _figures(reading: AttemptReading) -> tuple[float, float, int | None]:
    maxes = [g.util_max or 0.0 for g in reading.gpus]
    means = [g.util_mean or 0.0 for g in reading.gpus]
    mems = [g.mem_max for g in reading.gpus if g.mem_max is not None]
    return max(maxes), sum(means) / len(means), (sum(mems) if mems else None)


def _describe(reading: AttemptReading, rule: IdleRule, since: datetime) -> str:
    util_max, util_mean, mem = _figures(reading)
    held = f", holding {mem:,} MiB of GPU memory" if mem else ""
    gpus = len(reading.gpus)
    used = (
        f"; last used through the portal at {reading.used_at:%Y-%m-%d %H:%M:%S %Z}"
        if reading.used_at is not None
        else ""
    )
    return (
        f"idle since {since:%Y-%m-%d %H:%M:%S %Z}: its processes used at most "
        f"{util_max:.1f} % SM (mean {util_mean:.1f} %) on its "
        f"{gpus} GPU{'s' if gpus != 1 else ''}{held}; threshold {rule.threshold:g} %"
        f" for {timedelta(seconds=rule.window_s)}{used}"
    )


def _flag(
    reading: AttemptReading, rule: IdleRule, since: datetime, now: datetime
) -> bool:
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .select_related("owner")
            .get(pk=reading.job_id)
        )
        if job.status != Job.Status.RUNNING:
            return False
        util_max, util_mean, mem = _figures(reading)
        cancel_at = (
            now + timedelta(seconds=rule.grace_s) if rule.action == "cancel" else None
        )
        IdleFlag.objects.create(
            job=job,
            attempt_id=reading.attempt_id,
            since=since,
            flagged_at=now,
            checked_at=now,
            threshold=rule.threshold,
            window_s=rule.window_s,
            util_max=util_max,
            util_mean=util_mean,
            memory_mib=mem,
            gpus=len(reading.gpus),
            action=rule.action,
            cancel_at=cancel_at,
        )
        what = _describe(reading, rule, since)
        then = (
            f"; it will be cancelled at {cancel_at:%Y-%m-%d %H:%M:%S %Z} unless it"
            " becomes active"
            if cancel_at
            else ""
        )
        _event(job, f"flagged {what}{then}", source=JobEvent.Source.SYSTEM, at=now)
        url = settings.GPULAB_BASE_URL
        notify(
            job.owner,
            Kind.IDLE_WARNING,
            f"Job #{job.pk} {job.name} is idle",
            f"Job #{job.pk} ({job.name}) is {what}{then}."
            + (f"\n\n{url}/jobs/{job.pk}/" if url else ""),
            {
                "job_id": job.pk,
                "name": job.name,
                "since": since.isoformat(),
                "util_max": util_max,
                "util_mean": util_mean,
                "memory_mib": mem,
                "threshold": rule.threshold,
                "window_s": rule.window_s,
                "cancel_at": cancel_at.isoformat() if cancel_at else None,
            },
        )
    return True


def _clear(flag: IdleFlag, active_at: datetime, now: datetime) -> None:
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=flag.job_id)
        flag.cleared_at = now
        flag.cleared = IdleFlag.Cleared.ACTIVE
        flag.save(update_fields=["cleared_at", "cleared"])
        _event(
            job,
            f"active again at {active_at:%Y-%m-%d %H:%M:%S %Z}: idle flag cleared"
            + ("; it will not be cancelled" if flag.cancel_at else ""),
            source=JobEvent.Source.SYSTEM,
            at=now,
        )


def _refresh(flag: IdleFlag, reading: AttemptReading, now: datetime) -> None:
    util_max, util_mean, mem = _figures(reading)
    IdleFlag.objects.filter(pk=flag.pk).update(
        checked_at=now, util_max=util_max, util_mean=util_mean, memory_mib=mem
    )


def _cancel(flag: IdleFlag, now: datetime) -> bool:
    grace = (flag.cancel_at or now) - flag.flagged_at
    reason = (
        f"idle since {flag.since:%Y-%m-%d %H:%M:%S %Z} and still idle after the "
        f"{grace} grace period"
    )
    try:
        services.cancel_job(flag.job_id, by=None, reason=reason)
    except services.JobStateError as exc:
        log.info("idle job %s not cancelled: %s", flag.job_id, exc)
        return False
    IdleFlag.objects.filter(pk=flag.pk).update(
        cancelled_at=now, cleared_at=now, cleared=IdleFlag.Cleared.CANCELLED
    )
    return True
