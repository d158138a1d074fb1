"""Quota alerts at 80 % and 100 % of the GPU-hours: once per quota, threshold and
period, even when two passes record them at once; ``on_alert`` for each new one."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest

from portal.notifications.models import Delivery, Preference
from portal.quotas import alerts
from portal.quotas.alerts import record_alerts
from portal.quotas.models import QuotaAlert
from portal.quotas.usage import quota_states
from tests.portal.quotas.helpers import quota, run
from tests.scheduler.test_concurrency import _race

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)


def record(now: datetime = NOW) -> list[QuotaAlert]:
    return record_alerts(quota_states(now))


@pytest.mark.parametrize(
    ("used_h", "thresholds"),
    [(7.9, []), (8.0, [80]), (9.5, [80]), (10.0, [80, 100]), (25.0, [80, 100])],
)
def test_it_alerts_at_80_and_100_percent(
    cluster: Any, alice: Any, groups: Any, used_h: float, thresholds: list[int]
) -> None:
    q = quota(group=groups["vision"], gpu_hours=10)
    quota(group=groups["nlp"], max_gpus=2)  # no GPU-hour limit: never alerts
    run(alice, cluster[0], NOW - used_h * H - H, NOW - H)
    with mock.patch.object(alerts, "on_alert", autospec=True) as hook:
        got = record()
    assert sorted(a.threshold for a in got) == thresholds
    assert (
        sorted(QuotaAlert.objects.filter(quota=q).values_list("threshold", flat=True))
        == thresholds
    )
    # on_alert runs after commit: the test transaction never commits
    hook.assert_not_called()


def test_each_threshold_once_per_period_and_again_after_the_reset(
    cluster: Any, alice: Any, groups: Any, django_capture_on_commit_callbacks: Any
) -> None:
    q = quota(group=groups["vision"], gpu_hours=10, period="week")

    def passes(now: datetime) -> list[int]:
        """A pass's alerts, with their on-commit hooks run."""
        with django_capture_on_commit_callbacks(execute=True):
            return [a.threshold for a in record(now)]

    run(alice, cluster[0], NOW - 9 * H, NOW - H)  # 8 h: 80 %
    with mock.patch.object(alerts, "on_alert", autospec=True) as hook:
        assert passes(NOW) == [80]
        assert hook.call_count == 1
        assert passes(NOW) == []  # the next pass finds it recorded
        run(alice, cluster[0], NOW - H, NOW)  # 9 h: still 80 %
        assert passes(NOW + H) == []
        run(alice, cluster[0], NOW + H, NOW + 2 * H)  # 10 h: 100 %
        assert passes(NOW + 2 * H) == [100]
        assert hook.call_count == 2
        alert = hook.call_args.args[0]
        assert (alert.quota, alert.threshold) == (q, 100)
        assert alert.used_gpu_hours == pytest.approx(10.0)
        # next week (Monday 23 Nov): usage starts again, and so do the alerts
        monday = datetime(2026, 11, 23, tzinfo=UTC)
        run(alice, cluster[0], monday, monday + 8 * H)
        assert passes(monday + 8 * H) == [80]
        assert hook.call_args.args[0].period_start == monday
        assert hook.call_count == 3
    assert QuotaAlert.objects.filter(quota=q).count() == 3


@pytest.mark.django_db(transaction=True)
def test_two_passes_at_once_alert_once(cluster: Any, alice: Any, groups: Any) -> None:
    q = quota(group=groups["vision"], gpu_hours=10)
    run(alice, cluster[0], NOW - 11 * H, NOW - H)
    # both read the state (nothing alerted yet), then race to record
    states = [quota_states(NOW) for _ in range(4)]
    it = iter(states)
    with mock.patch.object(alerts, "on_alert", autospec=True) as hook:
        results, errors = _race(lambda: record_alerts(next(it)), 4)
    assert not errors
    assert sorted(a.threshold for r in results for a in r) == [80, 100]
    assert hook.call_count == 2
    assert QuotaAlert.objects.filter(quota=q).count() == 2


def test_on_alert_writes_a_log_line(
    caplog: pytest.LogCaptureFixture, groups: Any
) -> None:
    q = quota(group=groups["vision"], gpu_hours=10)
    alert = QuotaAlert(
        quota=q,
        threshold=80,
        period_start=datetime(2026, 11, 1, tzinfo=UTC),
        used_gpu_hours=8.25,
        limit_gpu_hours=10.0,
    )
    with caplog.at_level(logging.WARNING, logger="portal.quotas.alerts"):
        alerts.on_alert(alert)
    assert caplog.messages == [
        "quota alert: group vision reached 80% of its 10.0 GPU-hours this month"
        " (used 8.2, period from 2026-11-01T00:00:00+00:00)"
    ]


def test_an_alert_notifies_every_member_of_the_quotas_group(
    groups: Any, alice: Any, bob: Any, charlie: Any
) -> None:
    Preference.objects.create(user=bob, kinds=["job_failed"])  # chose not to hear
    q = quota(group=groups["vision"], gpu_hours=10)
    alert = QuotaAlert(
        quota=q, threshold=100, period_start=datetime(2026, 11, 1, tzinfo=UTC),
        used_gpu_hours=10.5, limit_gpu_hours=10.0,
    )  # fmt: skip

    alerts.on_alert(alert)

    sent = list(Delivery.objects.values_list("user__username", "kind", "subject"))
    assert sent == [("alice", "quota_warning", "Quota used up: group vision")]
    assert Delivery.objects.get().payload["threshold"] == 100
