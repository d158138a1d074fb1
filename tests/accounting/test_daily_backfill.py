"""The data migration that gives usage records written before ``DailyUsage`` their
daily rows: the rows ``recharge`` would have written (across midnight, on a shared
GPU whose share changed), each record's total kept whatever rule charged it, the
Usage page right for the old period, and a rerun adding nothing."""

from __future__ import annotations

import importlib
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

import pytest
from django.apps import apps as django_apps
from django.db import connection

from portal.accounting import reports
from portal.accounting.models import DailyUsage
from scheduler.models import UsageRecord
from tests.accounting.test_charges import GIB, end, join, run_alone
from tests.conftest import make_node
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

MIGRATION = importlib.import_module(
    "portal.accounting.migrations.0003_backfill_daily_usage"
)
MIDNIGHT = datetime(2027, 3, 2, tzinfo=UTC).timestamp()


def backfill() -> None:
    with connection.schema_editor() as editor:
        MIGRATION.backfill(django_apps, editor)


def daily() -> set[tuple[int, date, float, float | None, float | None]]:
    return {
        (d.record_id, d.day, round(d.gpu_seconds, 6),
         None if d.energy_j is None else round(d.energy_j, 6),
         None if d.busy_gpu_seconds is None else round(d.busy_gpu_seconds, 6))
        for d in DailyUsage.objects.all()
    }  # fmt: skip


def test_old_records_get_the_rows_the_charging_would_have_written(
    alice: User, bob: User
) -> None:
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=20 * GIB)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=60 * GIB)
    # A from 23:00, B joins at 23:30 (A's share drops from 1 to 1/4), both end
    # at 01:00 the next day
    first = run_alone(a, node, MIDNIGHT - 3600)
    second = join(b, gpu, node, a, MIDNIGHT - 1800)
    end(node, first, MIDNIGHT + 3600)
    end(node, second, MIDNIGHT + 3600)
    UsageRecord.objects.filter(attempt=first).update(energy_j=3.6e6, util_gpu_mean=50)
    written = daily()
    assert len(written) == 4
    DailyUsage.objects.all().delete()  # as before the table existed

    backfill()

    # the record's energy/util were changed above: compare seconds exactly, and
    # the energy and busy time as the record's now say
    got = daily()
    assert {(r, d, s) for r, d, s, _, _ in got} == {
        (r, d, s) for r, d, s, _, _ in written
    }
    rec = UsageRecord.objects.get(attempt=first)
    day_one = DailyUsage.objects.get(record=rec, day=date(2027, 3, 1))
    # 23:00-23:30 alone, 23:30-24:00 at a quarter: 1800 + 450 of 3150 s
    assert day_one.gpu_seconds == pytest.approx(2250)
    assert day_one.energy_j == pytest.approx(3.6e6 * 2250 / 3150)
    assert day_one.busy_gpu_seconds == pytest.approx(2250 * 0.5)

    backfill()  # a rerun adds nothing
    assert daily() == got


def test_a_record_charged_by_an_older_rule_keeps_its_total(
    alice: User, cluster: Any
) -> None:
    node = cluster[0]
    attempt = run_alone(JobFactory(owner=alice), node, MIDNIGHT - 3000)
    end(node, attempt, MIDNIGHT + 1000)
    # charged half the GPU (the old 1/n of slots rule), without daily rows
    UsageRecord.objects.filter(attempt=attempt).update(gpu_seconds=2000)
    DailyUsage.objects.all().delete()

    backfill()

    days = dict(
        DailyUsage.objects.filter(record__attempt=attempt).values_list(
            "day", "gpu_seconds"
        )
    )
    assert days == {
        date(2027, 3, 1): pytest.approx(1500),
        date(2027, 3, 2): pytest.approx(500),
    }


def test_the_usage_page_counts_the_old_period_after_it(
    alice: User, cluster: Any
) -> None:
    node = cluster[0]
    attempt = run_alone(JobFactory(owner=alice, gpus=2), node, MIDNIGHT - 3600)
    end(node, attempt, MIDNIGHT - 1800)
    DailyUsage.objects.all().delete()
    now = datetime.fromtimestamp(MIDNIGHT + 86400, UTC)
    scope = reports.Scope(user_id=alice.pk)
    day = date(2027, 3, 1)
    assert reports.report(scope, day, day, now).gpu_hours == 0  # the gap

    backfill()

    assert reports.report(scope, day, day, now).gpu_hours == pytest.approx(1.0)
