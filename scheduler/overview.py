"""The admin overview's figures, each one SQL aggregate (read only; a few
queries whatever the number of jobs, records or samples):

- ``group_usage``: GPU-hours per group since a time (this month), from the usage
  records (each clipped to the window in proportion to its span) plus the
  running attempts' GPU time so far by the charging rule their records will
  follow (``portal.accounting.live``);
- ``daily_utilisation``: per day, the share of the cluster's GPU time held by
  jobs (slots held / slots, from allocations) and the mean GPU utilisation the
  agents measured (hourly rollups of the persisted samples, weighted by sample
  count);
- ``daily_idle``: per day, GPU-hours held by jobs while the GPU's utilisation was
  under ``IDLE_UTIL_PERCENT`` (minute rollups joined to the allocations that held
  the GPU; a GPU held by two jobs counts once);
- ``nodes_needing_attention``: lost, draining or in maintenance.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING

from django.db import connection
from django.db.models import Count, OuterRef, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.accounting import live
from scheduler.models import Allocation, Gpu, Node

if TYPE_CHECKING:
    from django.db.models import QuerySet

# "Idle": the GPU's utilisation (SM busy, NVML's utilization.gpu) under this, in
# percent, whatever memory it holds (memory held with no SM activity is idle).
IDLE_UTIL_PERCENT = 5.0
DAYS = 30


@dataclass(frozen=True)
class GroupUsage:
    group_id: int
    name: str
    recorded_hours: float  # attempts that ended (usage records)
    running_hours: float  # attempts still running, up to now

    @property
    def hours(self) -> float:
        return self.recorded_hours + self.running_hours


@dataclass(frozen=True)
class DayFigures:
    day: date
    allocated_percent: float | None  # GPU time held by jobs / GPU time present
    util_percent: float | None  # mean measured utilisation of every GPU
    idle_hours: float  # GPU-hours held by jobs while under IDLE_UTIL_PERCENT


def month_start(now: datetime) -> datetime:
    local = timezone.localtime(now)
    return local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


_GROUP_USAGE_SQL = """
WITH recorded AS (
    SELECT r.group_id,
           sum(r.gpu_seconds * CASE
               WHEN r.ended_at > r.started_at THEN
                   extract(epoch FROM least(r.ended_at, %(now)s)
                                      - greatest(r.started_at, %(since)s))
                   / extract(epoch FROM r.ended_at - r.started_at)
               ELSE 1 END) AS seconds
    FROM scheduler_usagerecord r
    WHERE r.ended_at >= %(since)s AND r.started_at <= %(now)s
    GROUP BY r.group_id
)
SELECT g.id, g.name, coalesce(rec.seconds, 0)
FROM scheduler_group g
LEFT JOIN recorded rec ON rec.group_id = g.id
"""


def group_usage(since: datetime, now: datetime) -> list[GroupUsage]:
    """Every group's GPU-hours in [since, now], most used first. Two queries: the
    records, and the running attempts charged by the charging rule
    (``portal.accounting.live``)."""
    with connection.cursor() as cursor:
        cursor.execute(_GROUP_USAGE_SQL, {"since": since, "now": now})
        rows = cursor.fetchall()
    charges = live.load(now)
    running: dict[int, float] = {}
    for attempt_id, seconds in charges.seconds(since).items():
        group_id = charges.running[attempt_id][2]
        running[group_id] = running.get(group_id, 0.0) + seconds
    usage = [
        GroupUsage(pk, name, float(rec) / 3600, running.get(pk, 0.0) / 3600)
        for pk, name, rec in rows
    ]
    usage.sort(key=lambda u: (-u.hours, u.name))
    return usage


# Per local day: slot-seconds held (an allocation holds one slot of a GPU with
# ``slots`` slots: an exclusive job holds them all) over the GPUs present.
_ALLOCATED_SQL = """
WITH days AS (
    SELECT d AS day_start, d + interval '1 day' AS day_end
    FROM generate_series(%(first)s::timestamp, %(last)s::timestamp, interval '1 day') d
)
SELECT days.day_start::date,
       sum(extract(epoch FROM
               least(coalesce(a.released_at AT TIME ZONE %(tz)s, %(now_local)s),
                     days.day_end)
               - greatest(a.allocated_at AT TIME ZONE %(tz)s, days.day_start))
           / g.slots)
FROM scheduler_allocation a
JOIN scheduler_gpu g ON g.id = a.gpu_id
JOIN days ON a.allocated_at AT TIME ZONE %(tz)s < days.day_end
         AND coalesce(a.released_at AT TIME ZONE %(tz)s, %(now_local)s)
             > days.day_start
WHERE a.released_at IS NULL OR a.released_at >= %(since)s
GROUP BY 1
"""

_UTIL_SQL = """
SELECT (start AT TIME ZONE %(tz)s)::date,
       sum(util_gpu_mean * samples) / nullif(sum(samples), 0)
FROM scheduler_gpurollup
WHERE resolution = '1h' AND start >= %(since)s AND start < %(now)s
  AND util_gpu_mean IS NOT NULL
GROUP BY 1
"""

# A minute counts when an allocation held the GPU at its start; DISTINCT so a GPU
# two jobs share counts once.
_IDLE_SQL = """
SELECT (idle.start AT TIME ZONE %(tz)s)::date, count(*) / 60.0
FROM (
    SELECT DISTINCT r.gpu_id, r.start
    FROM scheduler_allocation a
    JOIN scheduler_gpurollup r
      ON r.gpu_id = a.gpu_id AND r.resolution = '1m'
     AND r.start >= greatest(a.allocated_at, %(since)s)
     AND r.start < coalesce(a.released_at, %(now)s)
    WHERE (a.released_at IS NULL OR a.released_at > %(since)s)
      AND r.util_gpu_mean < %(idle)s
) idle
GROUP BY 1
"""


def daily_figures(now: datetime, days: int = DAYS) -> list[DayFigures]:
    """The last ``days`` local days (today included, up to ``now``), oldest first.
    Three queries."""
    tz = timezone.get_current_timezone_name()
    local_now = timezone.localtime(now)
    first = (local_now - timedelta(days=days - 1)).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    since = first  # aware, local midnight
    params: dict[str, str | float | datetime] = {
        "tz": tz,
        "since": since,
        "now": now,
        "now_local": local_now.replace(tzinfo=None),
        "first": first.replace(tzinfo=None),
        "last": local_now.replace(
            hour=0, minute=0, second=0, microsecond=0, tzinfo=None
        ),
        "idle": IDLE_UTIL_PERCENT,
    }
    with connection.cursor() as cursor:
        cursor.execute(_ALLOCATED_SQL, params)
        allocated = {d: float(s or 0) for d, s in cursor.fetchall()}
        cursor.execute(_UTIL_SQL, params)
        util = {d: float(u) for d, u in cursor.fetchall() if u is not None}
        cursor.execute(_IDLE_SQL, params)
        idle = {d: float(h) for d, h in cursor.fetchall()}
    gpus = Gpu.objects.filter(present=True).count()
    out = []
    for i in range(days):
        day = (first + timedelta(days=i)).date()
        # today counts up to now, as the allocations do
        span = 86400.0
        if day == local_now.date():
            span = (
                local_now - local_now.replace(hour=0, minute=0, second=0, microsecond=0)
            ).total_seconds()
        capacity = gpus * span
        held = allocated.get(day)
        out.append(
            DayFigures(
                day=day,
                allocated_percent=(
                    min(100.0, 100 * held / capacity)
                    if held is not None and capacity > 0
                    else (0.0 if capacity > 0 else None)
                ),
                util_percent=util.get(day),
                idle_hours=idle.get(day, 0.0),
            )
        )
    return out


def nodes_needing_attention() -> QuerySet[Node]:
    """Lost, draining or in maintenance, with their jobs running now."""
    live = (
        Allocation.objects.filter(gpu__node=OuterRef("pk"), released_at__isnull=True)
        .order_by()
        .values("gpu__node")
        .annotate(n=Count("attempt__job", distinct=True))
        .values("n")[:1]
    )
    return Node.objects.needing_attention().annotate(
        n_running=Coalesce(Subquery(live), Value(0))
    )
