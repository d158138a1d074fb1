"""Quota alerts: a quota reaching 80 % and 100 % of its GPU-hours in a period.

``record_alerts`` runs in every scheduling pass with the states the pass loaded;
each (quota, threshold, period) is inserted once (``ON CONFLICT DO NOTHING`` on the
unique constraint, so two passes at once never alert twice) and ``on_alert`` is
called for each new one after commit.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

from django.db import connection, transaction
from django.utils import timezone

from portal.quotas.models import QuotaAlert

if TYPE_CHECKING:
    from collections.abc import Iterable

    from portal.quotas.usage import QuotaState

log = logging.getLogger(__name__)

_INSERT = """
INSERT INTO quotas_quotaalert
    (quota_id, threshold, period_start, used_gpu_hours, limit_gpu_hours, created_at)
SELECT * FROM unnest(%s::bigint[], %s::int[], %s::timestamptz[], %s::float8[],
                     %s::float8[], %s::timestamptz[])
ON CONFLICT (quota_id, threshold, period_start) DO NOTHING
RETURNING id, quota_id, threshold, period_start, used_gpu_hours, limit_gpu_hours,
          created_at
"""


def on_alert(alert: QuotaAlert) -> None:
    """The hook for a new alert. For now a log line; the notifications part of
    issue 6 (email, webhook) is wired here at merge."""
    quota = alert.quota
    log.warning(
        "quota alert: %s reached %d%% of its %.1f GPU-hours this %s (used %.1f,"
        " period from %s)",
        quota.target,
        alert.threshold,
        alert.limit_gpu_hours,
        quota.period_label,
        alert.used_gpu_hours,
        alert.period_start.isoformat(),
    )


def due(states: Iterable[QuotaState]) -> list[tuple[QuotaState, int]]:
    """The (state, threshold) pairs reached and not yet alerted this period."""
    out = []
    for state in states:
        percent = state.percent
        if percent is None:
            continue
        for threshold in QuotaAlert.THRESHOLDS:
            if percent >= threshold and state.alerted < threshold:
                out.append((state, threshold))
    return out


def record_alerts(states: Iterable[QuotaState]) -> list[QuotaAlert]:
    """Insert the alerts ``states`` have reached (one statement, only when some
    are due) and call ``on_alert`` for each one inserted, after commit."""
    states = list(states)
    todo = due(states)
    if not todo:
        return []
    now = timezone.now()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            _INSERT,
            [
                [s.quota.pk for s, _ in todo],
                [t for _, t in todo],
                [s.period_start for s, _ in todo],
                [s.used_gpu_hours for s, _ in todo],
                [s.limit_gpu_hours for s, _ in todo],
                [now for _ in todo],
            ],
        )
        rows = cursor.fetchall()
        quotas = {s.quota.pk: s.quota for s in states}
        alerts = []
        for pk, quota_id, threshold, start, used, limit, created in rows:
            alert = QuotaAlert(
                pk=pk,
                quota=quotas[quota_id],
                threshold=threshold,
                period_start=start,
                used_gpu_hours=used,
                limit_gpu_hours=limit,
                created_at=created,
            )
            alerts.append(alert)
            transaction.on_commit(partial(on_alert, alert))
    return alerts
