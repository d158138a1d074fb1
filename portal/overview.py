"""The admin overview's figures (read only; a few queries whatever the number of
jobs, records or samples):

- ``group_usage``: GPU-hours per group since a time (this month), from the usage
  records (each clipped to the window in proportion to its span) plus the
  running attempts' GPU time so far by the charging rule their records will
  follow (``portal.accounting.live``);
- ``daily_figures``: per local day, the share of the GPUs' time held by jobs
  (charged to them: agent-reported runs, a shared GPU's second once), the
  GPU-hours charged to jobs while they were idle (``portal.idle.evidence``, the
  idle flags' rule), both summed from the GPU hours ``portal.accounting.hours``
  keeps, and the mean utilisation the agents measured (hourly rollups of the
  persisted samples, weighted by sample count);
- ``idle_flags``: the jobs flagged idle now;
- ``nodes_needing_attention``: lost, draining or in maintenance.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connection
from django.db.models import Count, OuterRef, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.accounting import hours, live
from portal.idle.models import IdleFlag
from scheduler.models import Allocation, Gpu, Node

if TYPE_CHECKING:
    from django.db.models import QuerySet

DAYS = 30


@dataclass(frozen=True)
class GroupUsage:
    group_id: int
    name: str
    recorded_hours: float  # attempts that ended (usage records)
    running_hours: float  # attempts still running, up to now
    # work lost by preempted or requeued attempts: charged to nobody, not in
    # ``hours``
    lost_hours: float = 0.0

    @property
    def hours(self) -> float:
        return self.recorded_hours + self.running_hours


@dataclass(frozen=True)
class DayFigures:
    day: date
    allocated_percent: float | None  # GPU time held by jobs / GPU time present
    util_percent: float | None  # mean measured utilisation of every GPU
    # GPU-hours charged to jobs while idle (portal.idle.evidence); None: unknown
    # (computed after the day's samples were dropped)
    idle_hours: float | None


def month_start(now: datetime) -> datetime:
    local = timezone.localtime(now)
    return local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


# A record inside the window counts whole; one across its start or end, pro rata
# (date_part, not extract: extract's numeric arithmetic on every row takes half the
# time).
_GROUP_USAGE_SQL = """
WITH recorded AS (
    SELECT r.group_id,
           sum(CASE
               WHEN r.started_at >= %(since)s AND r.ended_at <= %(now)s
                   THEN r.gpu_seconds
               WHEN r.ended_at > r.started_at THEN
                   r.gpu_seconds * date_part('epoch', least(r.ended_at, %(now)s)
                                            - greatest(r.started_at, %(since)s))
                   / date_part('epoch', r.ended_at - r.started_at)
               ELSE r.gpu_seconds END) AS seconds,
           sum(CASE
               WHEN r.started_at >= %(since)s AND r.ended_at <= %(now)s
                   THEN r.lost_gpu_seconds
               WHEN r.ended_at > r.started_at THEN
                   r.lost_gpu_seconds * date_part('epoch', least(r.ended_at, %(now)s)
                                            - greatest(r.started_at, %(since)s))
                   / date_part('epoch', r.ended_at - r.started_at)
               ELSE r.lost_gpu_seconds END) AS lost
    FROM scheduler_usagerecord r
    WHERE r.ended_at >= %(since)s AND r.started_at <= %(now)s
    GROUP BY r.group_id
)
SELECT g.id, g.name, coalesce(rec.seconds, 0), coalesce(rec.lost, 0)
FROM scheduler_group g
LEFT JOIN recorded rec ON rec.group_id = g.id
"""


def group_usage(
    since: datetime, now: datetime, charges: live.LiveCharges | None = None
) -> list[GroupUsage]:
    """Every group's GPU-hours in [since, now], most used first. Two queries: the
    records, and the running attempts charged by the charging rule
    (``portal.accounting.live``; none when ``charges``, loaded at ``now``, is
    given)."""
    with connection.cursor() as cursor:
        cursor.execute(_GROUP_USAGE_SQL, {"since": since, "now": now})
        rows = cursor.fetchall()
    if charges is None:
        charges = live.load(now)
    running: dict[int, float] = {}
    for attempt_id, seconds in charges.seconds(since).items():
        group_id = charges.running[attempt_id][2]
        running[group_id] = running.get(group_id, 0.0) + seconds
    usage = [
        GroupUsage(
            pk, name, float(rec) / 3600, running.get(pk, 0.0) / 3600, float(lost) / 3600
        )
        for pk, name, rec, lost in rows
    ]
    usage.sort(key=lambda u: (-u.hours, u.name))
    return usage


# Both sum per hour first, then convert the ~720 hour starts to local days
# (not every row's).
_UTIL_SQL = """
SELECT (start AT TIME ZONE %(tz)s)::date, sum(s) / nullif(sum(n), 0)
FROM (SELECT start, sum(util_gpu_mean * samples) AS s, sum(samples) AS n
      FROM scheduler_gpurollup
      WHERE resolution = '1h' AND start >= %(since)s AND start < %(now)s
        AND util_gpu_mean IS NOT NULL
      GROUP BY start) h
GROUP BY 1
"""

# Held and idle GPU-seconds per local day, from the GPU hours the rollup keeps
# (``portal.accounting.hours``); an hour belongs to the day it starts in. Idle is
# unknown for a day none of whose held hours has it (computed after its samples
# were dropped).
_HOURS_SQL = """
SELECT (start AT TIME ZONE %(tz)s)::date, sum(held), sum(idle), sum(known)
FROM (SELECT start, sum(held_seconds) AS held, sum(idle_seconds) AS idle,
             count(idle_seconds) AS known
      FROM accounting_gpuhour
      WHERE start >= %(since)s AND start < %(now)s
      GROUP BY start) h
GROUP BY 1
"""


def daily_figures(now: datetime, days: int = DAYS) -> list[DayFigures]:
    """The last ``days`` local days (today included, up to where the GPU hours
    are computed), oldest first. Four small queries whatever the history."""
    tz = timezone.get_current_timezone()
    local_now = timezone.localtime(now)
    first = (local_now - timedelta(days=days - 1)).date()
    since = datetime.combine(first, time.min, tzinfo=tz)
    params: dict[str, Any] = {
        "tz": timezone.get_current_timezone_name(),
        "since": since,
        "now": now,
    }
    with connection.cursor() as cursor:
        cursor.execute(_HOURS_SQL, params)
        hours_of = {d: (float(h), i, n) for d, h, i, n in cursor.fetchall()}
        cursor.execute(_UTIL_SQL, params)
        util = {d: float(u) for d, u in cursor.fetchall() if u is not None}
    computed = hours.through()
    upto = now if computed is None else min(now, computed)
    gpus = Gpu.objects.filter(present=True).count()
    out = []
    for i in range(days):
        day = first + timedelta(days=i)
        start = datetime.combine(day, time.min, tzinfo=tz).astimezone(UTC)
        end = datetime.combine(day + timedelta(1), time.min, tzinfo=tz)
        # a day is 23 or 25 hours at a DST change; today counts up to ``upto``
        span = max(0.0, (min(end.astimezone(UTC), upto) - start).total_seconds())
        capacity = gpus * span
        held, idle, known = hours_of.get(day, (0.0, None, 0))
        out.append(
            DayFigures(
                day=day,
                allocated_percent=(
                    min(100.0, 100 * held / capacity) if capacity > 0 else None
                ),
                util_percent=util.get(day),
                idle_hours=(
                    float(idle) / 3600 if known else (None if held > 0 else 0.0)
                ),
            )
        )
    return out


def idle_flags() -> QuerySet[IdleFlag]:
    """The jobs flagged idle now (open flags), longest idle first, with their
    owners: what the idle detection flagged, as on each job's page."""
    return (
        IdleFlag.objects.filter(cleared_at__isnull=True)
        .select_related("job", "job__owner", "job__group")
        .order_by("since", "pk")
    )


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
