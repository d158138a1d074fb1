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

from portal.notifications import services as notifications
from portal.quotas.models import QuotaAlert
from scheduler.models import Membership

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
    """A new alert (after the pass committed it): a log line, and a "quota
    warning" notification (``portal.notifications``: e-mail and webhook, as each
    user chose) to the quota's user, or to every member of the quota's group."""
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
    if quota.user is not None:
        users = [quota.user]
    else:
        users = [m.user for m in Membership.objects.filter(group=quota.group_id)
                 .select_related("user").order_by("user_id")]  # fmt: skip
    what = "used up" if alert.threshold >= 100 else f"at {alert.threshold} %"
    subject = f"Quota {what}: {quota.target}"
    text = (
        f"The quota {quota.target} has used {alert.used_gpu_hours:.1f} of its"
        f" {alert.limit_gpu_hours:.1f} GPU-hours this {quota.period_label}."
        + (
            " New jobs charged to it wait until it resets."
            if alert.threshold >= 100 and quota.hard
            else ""
        )
    )
    payload = {
        "quota": quota.pk,
        "target": quota.target,
        "threshold": alert.threshold,
        "used_gpu_hours": alert.used_gpu_hours,
        "limit_gpu_hours": alert.limit_gpu_hours,
        "hard": quota.hard,
        "period_start": alert.period_start.isoformat(),
    }
    for user in users:
        notifications.notify(user, "quota_warning", subject, text, payload)


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
