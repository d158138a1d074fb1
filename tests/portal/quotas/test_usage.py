"""``quota_states``: GPU-hours used in the current period (ended attempts' records,
pro rata at the period's start, plus running attempts live) and GPUs held."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine

from portal.quotas.usage import quota_states
from scheduler import services
from scheduler.models import UsageRecord
from tests.factories import JobFactory, start_job
from tests.portal.quotas.helpers import quota, run

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)  # a Friday
H = timedelta(hours=1)


def states(now: datetime = NOW) -> dict[str, Any]:
    return {s.quota.target: s for s in quota_states(now)}


def test_it_counts_the_period_part_of_ended_records_by_group_and_user(
    cluster: Any, alice: Any, bob: Any, charlie: Any, groups: Any
) -> None:
    node = cluster[0]
    quota(group=groups["vision"], gpu_hours=100)
    quota(user=alice, gpu_hours=50)
    quota(group=groups["nlp"], gpu_hours=10)
    nov = datetime(2026, 11, 1, tzinfo=UTC)
    run(alice, node, nov - 2 * H, nov + 2 * H)  # 4 h, 2 h of them in November
    run(bob, node, nov + 9 * 24 * H, nov + 9 * 24 * H + 3 * H, gpus=2)  # 6 GPU-h
    run(alice, node, nov - 30 * H, nov - 20 * H)  # October only
    run(charlie, node, nov + 24 * H, nov + 29 * H)  # nlp: 5 h
    assert UsageRecord.objects.count() == 5

    got = states()
    assert got["group vision"].used_gpu_hours == pytest.approx(8.0)
    assert got["user alice"].used_gpu_hours == pytest.approx(2.0)
    assert got["group nlp"].used_gpu_hours == pytest.approx(5.0)
    assert got["group nlp"].percent == pytest.approx(50.0)
    assert got["group vision"].period_start == nov
    assert got["group vision"].period_end == datetime(2026, 12, 1, tzinfo=UTC)
    assert all(s.running_gpus == 0 for s in got.values())


def test_a_user_quota_counts_their_jobs_in_every_group(
    cluster: Any, alice: Any, groups: Any
) -> None:
    from scheduler.models import Membership

    Membership.objects.create(user=alice, group=groups["nlp"])
    quota(user=alice, gpu_hours=10)
    quota(group=groups["vision"], gpu_hours=10)
    run(alice, cluster[0], NOW - 5 * H, NOW - 4 * H, group=groups["vision"])
    run(alice, cluster[0], NOW - 3 * H, NOW - H, group=groups["nlp"])
    got = states()
    assert got["user alice"].used_gpu_hours == pytest.approx(3.0)
    assert got["group vision"].used_gpu_hours == pytest.approx(1.0)


def test_running_jobs_count_live_and_their_gpus_count_against_caps(
    cluster: Any, alice: Any, bob: Any, groups: Any
) -> None:
    node = cluster[0]
    quota(group=groups["vision"], gpu_hours=100, max_gpus=8)
    quota(user=bob, max_gpus=1)
    run(alice, node, NOW - 90 * timedelta(minutes=1), gpus=2)  # running: 3 GPU-h
    with time_machine.travel(NOW - timedelta(minutes=1), tick=False):
        start_job(JobFactory(owner=bob), node)  # STARTING: holds a GPU, no usage
    got = states()
    vision = got["group vision"]
    assert vision.used_gpu_hours == pytest.approx(3.0)
    assert vision.running_gpu_hours == pytest.approx(3.0)
    assert vision.running_gpus == 3
    assert got["user bob"].running_gpus == 1
    assert got["user bob"].used_gpu_hours == 0
    # live: half an hour later it has used one more GPU-hour
    assert states(NOW + 30 * timedelta(minutes=1))[
        "group vision"
    ].used_gpu_hours == pytest.approx(4.0)


def test_a_running_job_across_the_period_start_counts_from_the_start(
    cluster: Any, alice: Any, groups: Any
) -> None:
    quota(group=groups["vision"], gpu_hours=10, period="week")
    monday = datetime(2026, 11, 23, tzinfo=UTC)
    run(alice, cluster[0], monday - 2 * H)  # running since Sunday 22:00
    run(alice, cluster[0], monday - 5 * H, monday - 4 * H)  # Sunday, ended
    before = states(monday - timedelta(seconds=1))["group vision"]
    assert before.used_gpu_hours == pytest.approx(3.0, abs=1e-3)
    assert before.period_end == monday
    # the reset: at Monday 00:00 the week starts again
    at_reset = states(monday)["group vision"]
    assert at_reset.used_gpu_hours == 0
    assert at_reset.period_start == monday
    assert states(monday + 30 * timedelta(minutes=1))[
        "group vision"
    ].used_gpu_hours == pytest.approx(0.5)


def test_a_shared_gpu_charges_each_job_its_share(
    cluster: Any, alice: Any, charlie: Any, groups: Any
) -> None:
    from tests.factories import shared_start

    node = cluster[0]
    quota(group=groups["vision"], gpu_hours=10)
    quota(group=groups["nlp"], gpu_hours=10)
    with time_machine.travel(NOW - 2 * H, tick=False):
        a = start_job(JobFactory(owner=alice, shareable=True), node)
        services.mark_started(node.pk, _started(a, NOW - 2 * H))
    gpu_id = a.allocations.first().gpu_id  # type: ignore[union-attr]
    job = JobFactory(owner=charlie, shareable=True)
    with time_machine.travel(NOW - 2 * H, tick=False):
        services.apply_decisions([shared_start(job, gpu_id, node.pk, (a.job_id,))])
        b = job.attempt_set.get()
        services.mark_started(node.pk, _started(b, NOW - 2 * H))
    got = states()
    assert got["group vision"].used_gpu_hours == pytest.approx(1.0)
    assert got["group nlp"].used_gpu_hours == pytest.approx(1.0)
    assert got["group vision"].running_gpus == 1


def test_running_jobs_on_a_shared_gpu_count_as_their_records_will(
    cluster: Any, alice: Any, charlie: Any, groups: Any
) -> None:
    """Live usage follows the charging rule (declared memory here), the one the
    usage records follow when the jobs end: no jump at the end."""
    from tests.factories import shared_start

    node = cluster[0]
    quota(group=groups["vision"], gpu_hours=10)
    quota(group=groups["nlp"], gpu_hours=10)
    with time_machine.travel(NOW - 2 * H, tick=False):
        a = start_job(
            JobFactory(owner=alice, shareable=True, gpu_memory_mib=20480), node
        )
        services.mark_started(node.pk, _started(a, NOW - 2 * H))
    gpu_id = a.allocations.first().gpu_id  # type: ignore[union-attr]
    job = JobFactory(owner=charlie, shareable=True, gpu_memory_mib=61440)
    with time_machine.travel(NOW - H, tick=False):
        services.apply_decisions([shared_start(job, gpu_id, node.pk, (a.job_id,))])
        b = job.attempt_set.get()
        services.mark_started(node.pk, _started(b, NOW - H))

    got = states()
    # alice: 1 h alone, then 1 h at 20/80; charlie: 1 h at 60/80
    assert got["group vision"].running_gpu_hours == pytest.approx(1.25)
    assert got["group nlp"].running_gpu_hours == pytest.approx(0.75)

    from tests.factories import exited_data

    with time_machine.travel(NOW, tick=False):
        for attempt in (a, b):
            services.finish_attempt(
                node.pk, exited_data(attempt, 0, at=NOW.timestamp())
            )
    ended = states()
    assert ended["group vision"].running_gpu_hours == 0
    assert ended["group vision"].used_gpu_hours == pytest.approx(1.25)
    assert ended["group nlp"].used_gpu_hours == pytest.approx(0.75)


def _started(attempt: Any, at: datetime) -> Any:
    from tests.factories import started_data

    return started_data(attempt, at.timestamp())


@pytest.mark.parametrize(
    ("period", "days", "anchor", "now", "start", "end"),
    [
        ("month", None, None, "2026-02-14T08:00", "2026-02-01", "2026-03-01"),
        ("month", None, None, "2026-12-31T23:59", "2026-12-01", "2027-01-01"),
        ("week", None, None, "2026-11-22T23:00", "2026-11-16", "2026-11-23"),
        ("week", None, None, "2026-11-23T00:00", "2026-11-23", "2026-11-30"),
        ("days", 10, "2026-11-01", "2026-11-10T23:59", "2026-11-01", "2026-11-11"),
        ("days", 10, "2026-11-01", "2026-11-11T00:00", "2026-11-11", "2026-11-21"),
        ("days", 10, "2026-11-01", "2026-10-31T12:00", "2026-10-22", "2026-11-01"),
    ],
)
def test_period_bounds(
    period: str, days: int | None, anchor: str | None, now: str, start: str, end: str
) -> None:
    from datetime import date

    from portal.quotas.models import Quota

    q = Quota(period=period, period_days=days)
    if anchor:
        q.anchor = date.fromisoformat(anchor)
    got = q.period_bounds(datetime.fromisoformat(now).replace(tzinfo=UTC))
    assert got == (
        datetime.fromisoformat(start).replace(tzinfo=UTC),
        datetime.fromisoformat(end).replace(tzinfo=UTC),
    )


@pytest.mark.django_db
def test_it_reads_all_quotas_in_three_queries_or_two_in_the_pass(
    django_assert_num_queries: Any, groups: Any
) -> None:
    from portal.accounting import live
    from scheduler.models import Group

    for i in range(5):
        quota(group=Group.objects.create(name=f"g{i}"), gpu_hours=i + 1)
    # quotas, ended usage and GPUs held, running attempts' charges
    with django_assert_num_queries(3):
        assert len(quota_states(NOW)) == 5
    # the pass hands over the running attempts' charges it loaded for fair share
    charges = live.load(NOW)
    with django_assert_num_queries(2):
        assert len(quota_states(NOW, live_charges=charges)) == 5


def test_periods_start_at_midnight_in_the_configured_time_zone(settings: Any) -> None:
    from zoneinfo import ZoneInfo

    from portal.quotas.models import Quota

    settings.TIME_ZONE = "Europe/Berlin"
    berlin = ZoneInfo("Europe/Berlin")
    # 30 Nov 23:30 UTC is already 1 Dec in Berlin
    start, end = Quota(period="month").period_bounds(
        datetime(2026, 11, 30, 23, 30, tzinfo=UTC)
    )
    assert start == datetime(2026, 12, 1, tzinfo=berlin)
    assert start.astimezone(UTC) == datetime(2026, 11, 30, 23, 0, tzinfo=UTC)
    assert end == datetime(2027, 1, 1, tzinfo=berlin)
