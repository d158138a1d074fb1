"""GPU metric history: partitions, ingest, rollups, retention and history queries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection

from agents import protocol
from scheduler import metrics, services
from scheduler.models import Allocation, Attempt, GpuRollup, GpuSample, Job
from tests.conftest import make_node
from tests.samples import insert_samples

if TYPE_CHECKING:
    from django.contrib.auth.models import User

NOW = datetime(2026, 11, 22, 12, 0, 30, tzinfo=UTC)


def sample_frame(gpus: list[Any], at: datetime, util: float, **extra: Any) -> Any:
    return protocol.MetricsData(
        sampled_at=at.timestamp(),
        gpus=[
            protocol.GpuSample(index=g.index, uuid=g.uuid, util_gpu=util, **extra)
            for g in gpus
        ],
    )


@pytest.fixture
def node(db: None) -> Any:
    # The samples are at the fixed NOW: its daily partitions must exist whatever
    # today is (migrations make them around the real date only).
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, NOW)
    return make_node("hist-node", 2)[0]


def store(node: Any, at: datetime, util: float, **extra: Any) -> metrics.StoreResult:
    gpus = list(node.gpus.order_by("index"))
    frame = sample_frame(gpus, at, util, **extra)
    return metrics.store_samples({g.index: g.pk for g in gpus}, frame, now=NOW)


def test_it_keeps_partitions_from_the_retention_window_to_two_days_ahead(
    db: None, settings: Any
) -> None:
    settings.GPULAB_METRICS_RETENTION_DAYS = 3
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, NOW)
        days = [day for _, day in metrics.partitions(cursor)]

    wanted = {NOW.date() + timedelta(days=d) for d in range(-3, 3)}
    assert wanted <= set(days)


def test_it_drops_whole_partitions_past_retention_and_keeps_the_rest(
    node: Any, settings: Any
) -> None:
    settings.GPULAB_METRICS_RETENTION_DAYS = 7
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, NOW - timedelta(days=9))
        metrics.ensure_partitions(cursor, NOW)
    old = NOW - timedelta(days=8, hours=1)
    kept = NOW - timedelta(days=2)
    gpu = node.gpus.get(index=0)
    # Written directly: store_samples itself refuses samples past retention.
    for at, util in [(old, 1), (kept, 2)]:
        insert_samples([(gpu.pk, at, util, *[None] * 9, False, "[]")])

    with connection.cursor() as cursor:
        dropped = metrics.drop_old_partitions(cursor, NOW)

    assert metrics._partition_name(old.date()) in dropped
    assert metrics._partition_name(kept.date()) not in dropped
    assert list(GpuSample.objects.values_list("util_gpu", flat=True)) == [2.0]


def test_it_stores_a_replayed_sample_once(node: Any) -> None:
    at = NOW - timedelta(minutes=5)

    first = store(node, at, 50.0)
    again = store(node, at, 99.0)

    assert first.stored == 2
    assert again.stored == 2  # offered, ignored by the (gpu, at) primary key
    assert sorted(GpuSample.objects.values_list("util_gpu", flat=True)) == [50.0, 50.0]


@pytest.mark.parametrize(
    "at",
    [NOW - timedelta(days=30), NOW + timedelta(hours=3)],
    ids=["past retention", "future clock"],
)
def test_it_refuses_samples_outside_the_window(node: Any, at: datetime) -> None:
    result = store(node, at, 50.0)

    assert result == metrics.StoreResult(stored=0, refused=2)
    assert not GpuSample.objects.exists()


def test_it_keeps_process_samples_with_their_owner(node: Any) -> None:
    gpu = node.gpus.get(index=0)
    frame = protocol.MetricsData(
        sampled_at=(NOW - timedelta(seconds=5)).timestamp(),
        gpus=[
            protocol.GpuSample(
                index=0,
                uuid=gpu.uuid,
                util_gpu=70.0,
                processes=[
                    protocol.ProcessSample(pid=10, used_memory_mib=512, attempt_id=7),
                    protocol.ProcessSample(pid=11, used_memory_mib=64),
                ],
            )
        ],
    )

    metrics.store_samples({0: gpu.pk}, frame, now=NOW)

    [row] = GpuSample.objects.filter(gpu_id=gpu.pk).values_list("processes", flat=True)
    assert row == [
        {"pid": 10, "used_memory_mib": 512, "sm_util": None, "attempt_id": 7},
        {"pid": 11, "used_memory_mib": 64, "sm_util": None, "attempt_id": None},
    ]


def test_it_rolls_samples_up_to_minutes_and_hours(node: Any) -> None:
    minute = datetime(2026, 11, 22, 11, 58, tzinfo=UTC)
    for second, util in [(0, 10.0), (10, 20.0), (20, 60.0)]:
        store(node, minute + timedelta(seconds=second), util, power_w=100.0 + util)
    store(node, minute + timedelta(minutes=1, seconds=5), 90.0, power_w=190.0)

    metrics.rollup(NOW)

    gpu = node.gpus.get(index=0)
    first = GpuRollup.objects.get(gpu_id=gpu.pk, resolution="1m", start=minute)
    assert first.samples == 3
    assert (first.util_gpu_min, first.util_gpu_max) == (10.0, 60.0)
    assert first.util_gpu_mean == pytest.approx(30.0)
    assert first.power_max == 160.0
    hour = GpuRollup.objects.get(
        gpu_id=gpu.pk, resolution="1h", start=datetime(2026, 11, 22, 11, tzinfo=UTC)
    )
    assert hour.samples == 4
    # Weighted by samples: (10 + 20 + 60 + 90) / 4, not the mean of minute means.
    assert hour.util_gpu_mean == pytest.approx(45.0)
    assert hour.util_gpu_max == 90.0


def test_a_rollup_rerun_folds_in_a_late_sample_without_duplicating(node: Any) -> None:
    minute = datetime(2026, 11, 22, 11, 50, tzinfo=UTC)
    store(node, minute, 10.0)
    metrics.rollup(NOW)
    store(node, minute + timedelta(seconds=30), 30.0)  # replayed late

    metrics.rollup(NOW)

    gpu = node.gpus.get(index=0)
    [row] = GpuRollup.objects.filter(gpu_id=gpu.pk, resolution="1m", start=minute)
    assert row.samples == 2
    assert row.util_gpu_mean == pytest.approx(20.0)


def test_an_open_minute_is_not_rolled_up(node: Any) -> None:
    store(node, NOW - timedelta(seconds=10), 10.0)  # 12:00:20, minute still open

    metrics.rollup(NOW)

    assert not GpuRollup.objects.filter(resolution="1m").exists()


@pytest.mark.parametrize(
    ("span", "resolution"),
    [
        (timedelta(minutes=15), "raw"),
        (timedelta(hours=6), "1m"),
        (timedelta(days=7), "1h"),
    ],
)
def test_it_picks_the_resolution_for_the_range(
    span: timedelta, resolution: str
) -> None:
    assert metrics.resolution_for(span) == resolution


def test_a_gpu_history_is_one_query(node: Any, django_assert_num_queries: Any) -> None:
    gpu = node.gpus.get(index=0)
    now = datetime.now(tz=UTC)
    for minutes in (10, 5, 1):
        at = now - timedelta(minutes=minutes)
        metrics.store_samples(
            {0: gpu.pk}, sample_frame([gpu], at, float(minutes)), now=now
        )

    with django_assert_num_queries(1):
        resolution, rows = metrics.gpu_history(gpu.pk, now - timedelta(minutes=15))

    assert resolution == "raw"
    assert [r["util_gpu"] for r in rows] == [10.0, 5.0, 1.0]


def test_a_job_history_is_one_query_over_the_gpus_it_held_while_it_held_them(
    node: Any, alice: User, django_assert_num_queries: Any
) -> None:
    gpu0, gpu1 = node.gpus.order_by("index")
    now = datetime.now(tz=UTC)
    job = services.submit_job(alice, services.JobRequest(name="j", command="true"))
    attempt = Attempt.objects.create(
        job=job,
        number=1,
        node=node,
        started_at=now - timedelta(minutes=5),
        ended_at=now - timedelta(minutes=2),
    )
    Allocation.objects.bulk_create(
        [Allocation(attempt=attempt, gpu=gpu0, slot=s) for s in range(gpu0.slots)]
    )
    Job.objects.filter(pk=job.pk).update(status=Job.Status.COMPLETED)
    for minutes in (6, 4, 3, 1):  # before, during, during, after the attempt
        at = now - timedelta(minutes=minutes)
        frame = sample_frame([gpu0, gpu1], at, float(minutes))
        metrics.store_samples({0: gpu0.pk, 1: gpu1.pk}, frame, now=now)

    with django_assert_num_queries(1):
        rows = metrics.job_history(job.pk)

    assert [(r["gpu_id"], r["util_gpu"]) for r in rows] == [
        (gpu0.pk, 4.0),
        (gpu0.pk, 3.0),
    ]


def test_the_beat_task_maintains_partitions_and_rollups(node: Any) -> None:
    from scheduler.tasks import maintain_metrics

    gpu = node.gpus.get(index=0)
    now = datetime.now(tz=UTC)
    at = now - timedelta(minutes=3)
    metrics.store_samples({0: gpu.pk}, sample_frame([gpu], at, 40.0), now=now)

    result = maintain_metrics()

    assert result["rollup_rows"] >= 1
    assert GpuRollup.objects.filter(resolution="1m").exists()
