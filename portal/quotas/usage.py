"""What each quota has used in its current period: the one place quotas read usage.

``quota_states`` reads ended attempts' ``UsageRecord`` rows (the part of each
record inside the period, pro rata when a record spans the period's start) and
the GPUs the live attempts hold (STARTING ones too) for the concurrent caps, in
one SQL statement for all quotas whatever their number and the history's size;
and the running attempts' GPU time inside the period by the charging rule their
records will follow (``portal.accounting.live``: one more query, or none when the
caller, the scheduling pass, has loaded it already).

The ``ended`` part reads the records rather than ``DailyUsage``: a period starts
at a local midnight (``TIME_ZONE``), the rollup's days are UTC days.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.db import connection
from django.utils import timezone

from portal.accounting import live
from portal.quotas.alerts import record_alerts
from portal.quotas.models import Quota
from scheduler import policy

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from datetime import datetime

    from scheduler import hooks

# q: the quotas with the start of their current period. A record or attempt
# counts for a quota when it is the quota's group's (charged to it) or its user's.
_USAGE_SQL = """
WITH q AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(groups)s::bigint[], %(users)s::int[],
                         %(since)s::timestamptz[])
        AS q(id, group_id, user_id, since)
), ended AS (
    SELECT q.id, sum(
        CASE WHEN r.started_at >= q.since AND r.ended_at <= %(now)s
            THEN r.gpu_seconds
        WHEN r.ended_at > r.started_at THEN
            r.gpu_seconds * greatest(0.0, date_part('epoch',
                least(r.ended_at, %(now)s) - greatest(r.started_at, q.since)))
            / date_part('epoch', r.ended_at - r.started_at)
        ELSE r.gpu_seconds END) AS seconds
    FROM q JOIN scheduler_usagerecord r
        ON (r.group_id = q.group_id OR r.user_id = q.user_id)
        AND r.ended_at > q.since AND r.started_at < %(now)s
    GROUP BY q.id
), live AS (
    SELECT t.id, j.owner_id, j.group_id, count(DISTINCT a.gpu_id) AS gpus
    FROM scheduler_allocation a
    JOIN scheduler_attempt t ON t.id = a.attempt_id
    JOIN scheduler_job j ON j.id = t.job_id
    WHERE a.released_at IS NULL AND t.ended_at IS NULL
    GROUP BY t.id, j.owner_id, j.group_id
), running AS (
    SELECT q.id, sum(l.gpus) AS gpus
    FROM q JOIN live l ON (l.group_id = q.group_id OR l.owner_id = q.user_id)
    GROUP BY q.id
), alerted AS (
    SELECT q.id, max(a.threshold) AS threshold
    FROM q JOIN quotas_quotaalert a ON a.quota_id = q.id AND a.period_start = q.since
    GROUP BY q.id
)
SELECT q.id, coalesce(e.seconds, 0.0)::float8, coalesce(r.gpus, 0)::int,
       coalesce(al.threshold, 0)::int
FROM q
LEFT JOIN ended e ON e.id = q.id
LEFT JOIN running r ON r.id = q.id
LEFT JOIN alerted al ON al.id = q.id
"""


@dataclass(frozen=True)
class QuotaState:
    """A quota in its current period: what it used (running jobs included), the
    GPUs its jobs hold now, and the highest alert threshold already recorded."""

    quota: Quota
    period_start: datetime
    period_end: datetime
    used_gpu_hours: float
    running_gpu_hours: float  # the part of ``used_gpu_hours`` from running jobs
    running_gpus: int
    alerted: int  # 0, 80 or 100

    @property
    def limit_gpu_hours(self) -> float | None:
        g = self.quota.gpu_hours
        return None if g is None else float(g)

    @property
    def percent(self) -> float | None:
        """Used / limit in % (None without a GPU-hour limit; a zero limit: 100 %
        once anything is used, else 0)."""
        limit = self.limit_gpu_hours
        if limit is None:
            return None
        if limit <= 0:
            return 100.0 if self.used_gpu_hours > 0 else 0.0
        return 100.0 * self.used_gpu_hours / limit

    @property
    def exhausted(self) -> bool:
        limit = self.limit_gpu_hours
        return limit is not None and self.used_gpu_hours >= limit

    def view(self) -> policy.QuotaView:
        """The policy's input for this quota."""
        q = self.quota
        return policy.QuotaView(
            id=q.pk,
            group=q.group.name if q.group is not None else "",
            user=q.user.get_username() if q.user is not None else "",
            hard=q.hard,
            gpu_hours=self.limit_gpu_hours,
            used_gpu_hours=self.used_gpu_hours,
            max_gpus=q.max_gpus,
            running_gpus=self.running_gpus,
            period=q.period_label,
            resets_at=self.period_end.timestamp(),
        )


def quota_states(
    now: datetime | None = None,
    quotas: Iterable[Quota] | None = None,
    *,
    live_charges: live.LiveCharges | None = None,
) -> list[QuotaState]:
    """Every quota's state at ``now`` (or those of ``quotas``, with their group and
    user loaded): one query for the quotas (unless given), one for the ended
    usage and the GPUs held, one for the running attempts' charges (unless
    ``live_charges``, loaded at ``now``, is given)."""
    now = now or timezone.now()
    if quotas is None:
        quotas = Quota.objects.select_related("group", "user")
    quotas = list(quotas)
    if not quotas:
        return []
    bounds = {q.pk: q.period_bounds(now) for q in quotas}
    with connection.cursor() as cursor:
        cursor.execute(
            _USAGE_SQL,
            {
                "ids": [q.pk for q in quotas],
                "groups": [q.group_id for q in quotas],
                "users": [q.user_id for q in quotas],
                "since": [bounds[q.pk][0] for q in quotas],
                "now": now,
            },
        )
        rows = {row[0]: row[1:] for row in cursor.fetchall()}
    running = _running_seconds(
        quotas, bounds, live_charges if live_charges is not None else live.load(now)
    )
    out = []
    for q in quotas:
        ended, gpus, alerted = rows.get(q.pk, (0.0, 0, 0))
        running_s = running.get(q.pk, 0.0)
        start, end = bounds[q.pk]
        out.append(
            QuotaState(
                quota=q,
                period_start=start,
                period_end=end,
                used_gpu_hours=(ended + running_s) / 3600.0,
                running_gpu_hours=running_s / 3600.0,
                running_gpus=gpus,
                alerted=alerted,
            )
        )
    return out


def _running_seconds(
    quotas: list[Quota],
    bounds: dict[int, tuple[datetime, datetime]],
    charges: live.LiveCharges,
) -> dict[int, float]:
    """Each quota's running attempts' GPU-seconds since its period started (the
    part of a run before the period start is not counted)."""
    by_since: dict[datetime, dict[int, float]] = {}
    out: dict[int, float] = {}
    for q in quotas:
        since = bounds[q.pk][0]
        if since not in by_since:  # a few distinct period starts at most
            by_since[since] = charges.seconds(since)
        total = 0.0
        for attempt_id, seconds in by_since[since].items():
            _, user_id, group_id = charges.running[attempt_id]
            if group_id == q.group_id or user_id == q.user_id:
                total += seconds
        out[q.pk] = total
    return out


class Provider:
    """``scheduler.hooks.Quotas``: the quota states a scheduling pass reads, and
    the alerts recorded once it applied its decisions."""

    def states(self, now: datetime, usage: hooks.RunningUsage) -> Sequence[QuotaState]:
        # The usage is the one ``portal.accounting`` provided to the same pass.
        if not isinstance(usage, live.LiveCharges):
            raise TypeError(f"expected portal.accounting's LiveCharges, got {usage!r}")
        return quota_states(now, live_charges=usage)

    def pass_applied(self, states: Sequence[hooks.QuotaState]) -> int:
        return len(record_alerts(s for s in states if isinstance(s, QuotaState)))
