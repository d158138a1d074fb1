"""The GPU hours the admin overview reads (``portal.accounting.hours``): held time
from the agent-reported runs, idle time by the idle flags' rule (own processes
under the class threshold, memory no excuse, a gap no evidence, a shared GPU's
idle job counted at its share), recomputed whole so a rerun or a crash never adds
twice, going on where a run stopped, and looking again when a late report or a
late sample changes the past."""

from __future__ import annotations

import importlib
import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest
import time_machine
from django.apps import apps as django_apps
from django.db import connection

from portal.accounting import hours
from portal.accounting.models import GpuHour, GpuHourStale
from scheduler import metrics, services
from scheduler.models import Attempt
from tests.conftest import make_node
from tests.factories import (
    JobFactory,
    exited_data,
    shared_start,
    start_job,
    started_data,
)
from tests.samples import insert_samples

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Gpu, Job, Node

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 18, 12, 0, tzinfo=UTC)
T = datetime(2026, 11, 18, 9, 0, tzinfo=UTC)  # the runs start here
STEP = timedelta(seconds=10)  # GPULAB_METRICS_PERSIST_INTERVAL's default
GIB = 1024


@pytest.fixture
def node(db: None) -> Node:
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, NOW)
    GpuHourStale.objects.all().delete()  # the migration's backfill mark
    return make_node("hours-node", 2)[0]


def begin(job: Job, node: Node, at: datetime, gpus: list[Gpu] | None = None) -> Any:
    attempt = start_job(job, node, gpus)
    assert services.mark_started(node.pk, started_data(attempt, at.timestamp()))
    return attempt


def finish(
    node: Node, attempt: Attempt, at: datetime, reported: datetime | None = None
) -> None:
    """The agent reports (at ``reported``, default then) that it ended at ``at``."""
    with time_machine.travel(reported or at, tick=False):
        assert services.finish_attempt(
            node.pk, exited_data(attempt, 0, at=at.timestamp())
        )


def samples(gpu: Gpu, start: datetime, end: datetime, procs: Any) -> None:
    """A sample every STEP in [start, end); ``procs(at)``: the processes then
    (None: no sample at that time)."""
    rows, at = [], start
    while at < end:
        listed = procs(at)
        if listed is not None:
            util = min(100.0, sum(p["sm_util"] or 0 for p in listed))
            rows.append((gpu.pk, at, util, *[None] * 9, False, json.dumps(listed)))
        at += STEP
    insert_samples(rows)


def proc(attempt: Attempt, sm: float | None, mem: int = 20000) -> dict[str, Any]:
    return {"pid": 9, "used_memory_mib": mem, "sm_util": sm, "attempt_id": attempt.pk}


def gpu_of(attempt: Attempt) -> Gpu:
    return attempt.allocations.select_related("gpu").first().gpu  # type: ignore[union-attr]


def maintain(now: datetime = NOW, since: datetime = T) -> dict[str, Any]:
    hours.request_recompute(since)
    with time_machine.travel(now, tick=False):
        return hours.maintain(now)


def table() -> dict[tuple[int, str], tuple[float, float | None]]:
    return {
        (h.gpu_id, f"{h.start:%H}"): (
            round(h.held_seconds, 3),
            None if h.idle_seconds is None else round(h.idle_seconds, 3),
        )
        for h in GpuHour.objects.all()
    }


def test_memory_held_at_zero_sm_is_idle_and_a_gap_is_no_evidence(
    alice: User, node: Node
) -> None:
    attempt = begin(JobFactory(owner=alice), node, T)
    gpu = gpu_of(attempt)
    # 09:00-09:20 holding 20 GiB at 0 % SM; 09:20-09:30 nothing sampled (agent
    # cut off); 09:30-09:40 idle again with one sample missing (09:35, within
    # the allowed gap: still evidence); busy 09:40-10:00
    samples(gpu, T, T + timedelta(minutes=20), lambda at: [proc(attempt, 0.0)])
    samples(
        gpu,
        T + timedelta(minutes=30),
        T + timedelta(minutes=40),
        lambda at: None if at == T + timedelta(minutes=35) else [proc(attempt, 1.0)],
    )
    samples(
        gpu,
        T + timedelta(minutes=40),
        T + timedelta(minutes=60),
        lambda at: [proc(attempt, 60.0)],
    )
    finish(node, attempt, T + timedelta(hours=1))

    maintain()

    # 20 min + 10 min idle; the 10 unsampled minutes are not
    assert table() == {(gpu.pk, "09"): (3600.0, 1200.0 + 600.0)}


def test_the_class_threshold_decides_and_own_processes_count_on_a_shared_gpu(
    settings: Any, alice: User, bob: User, node: Node
) -> None:
    settings.GPULAB_PRIORITY_CLASSES = {
        **settings.GPULAB_PRIORITY_CLASSES,
        "high": {**settings.GPULAB_PRIORITY_CLASSES["high"], "idle_threshold": 30},
    }
    gpu = node.gpus.get(index=0)
    first = JobFactory(
        owner=alice, shareable=True, gpu_memory_mib=20 * GIB, priority_class="high"
    )
    a = begin(first, node, T, [gpu])
    second = JobFactory(owner=bob, shareable=True, gpu_memory_mib=60 * GIB)
    assert services.apply_decisions(
        [shared_start(second, gpu.pk, node.pk, (first.pk,))]
    ).started
    b = Attempt.objects.get(job=second)
    assert services.mark_started(node.pk, started_data(b, T.timestamp()))
    # both at 20 % SM of their own: under "high"'s 30 %, over "normal"'s 5 %
    samples(gpu, T, T + timedelta(hours=1), lambda at: [proc(a, 20.0), proc(b, 20.0)])
    finish(node, a, T + timedelta(hours=1))
    finish(node, b, T + timedelta(hours=1))

    maintain()

    # the GPU ran an hour; alice's job was idle at its share, 20 of 80 GiB
    assert table() == {(gpu.pk, "09"): (3600.0, 900.0)}


def test_running_jobs_count_up_to_the_last_run_and_a_rerun_never_adds_twice(
    alice: User, node: Node
) -> None:
    attempt = begin(JobFactory(owner=alice), node, T)
    gpu = gpu_of(attempt)
    samples(gpu, T, NOW, lambda at: [proc(attempt, 0.0)])

    first = maintain(now=T + timedelta(hours=1, minutes=30, seconds=20))
    assert table() == {
        (gpu.pk, "09"): (3600.0, 3600.0),
        (gpu.pk, "10"): (1800.0, 1800.0),
    }
    assert (
        first["gpu_hours_through"] == (T + timedelta(hours=1, minutes=30)).isoformat()
    )
    assert hours.through() == T + timedelta(hours=1, minutes=30)

    # the next runs (beat, every minute) go on from where the last stopped, and
    # two runs over the same hours leave the same rows
    with time_machine.travel(NOW, tick=False):
        hours.maintain(NOW)
        hours.maintain(NOW)
    assert table() == {
        (gpu.pk, "09"): (3600.0, 3600.0),
        (gpu.pk, "10"): (3600.0, 3600.0),
        (gpu.pk, "11"): (3600.0, 3600.0),
    }
    assert GpuHour.objects.count() == 3
    assert list(GpuHourStale.objects.values_list("since", flat=True)) == [NOW]


def test_a_crash_mid_run_loses_nothing_and_a_rerun_completes(
    alice: User, node: Node
) -> None:
    attempt = begin(JobFactory(owner=alice), node, T - timedelta(days=3))
    finish(node, attempt, T)
    gpu = gpu_of(attempt)
    calls = 0
    real = hours.compute

    def crash_on_the_third_chunk(since: datetime, until: datetime) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("worker killed")
        return real(since, until)

    hours.request_recompute(T - timedelta(days=3))
    with (
        mock.patch.object(hours, "compute", crash_on_the_third_chunk),
        time_machine.travel(NOW, tick=False),
        pytest.raises(RuntimeError),
    ):
        hours.maintain(NOW)
    # two whole days done and a mark where to go on; nothing half written
    assert sum(h.held_seconds for h in GpuHour.objects.all()) == 2 * 86400
    assert list(GpuHourStale.objects.values_list("since", flat=True)) == [
        T - timedelta(days=1)
    ]

    with time_machine.travel(NOW, tick=False):
        hours.maintain(NOW)

    held = GpuHour.objects.filter(gpu=gpu).values_list("held_seconds", flat=True)
    assert sum(held) == 3 * 86400
    assert len(held) == 72


def test_a_run_out_of_time_goes_on_at_the_next_run(
    alice: User, node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt = begin(JobFactory(owner=alice), node, T - timedelta(days=3))
    finish(node, attempt, T)
    monkeypatch.setattr(hours, "BUDGET_S", 0.0)  # one chunk per run

    hours.request_recompute(T - timedelta(days=3))
    runs = 0
    with time_machine.travel(NOW, tick=False):
        while True:
            runs += 1
            done = hours.maintain(NOW)
            if done["gpu_hours_through"] == NOW.isoformat():
                break

    assert runs == 4  # three days and today's hours
    assert sum(GpuHour.objects.values_list("held_seconds", flat=True)) == 3 * 86400


def test_an_exit_reported_late_has_the_hours_computed_again(
    alice: User, node: Node
) -> None:
    attempt = begin(JobFactory(owner=alice), node, T)
    gpu = gpu_of(attempt)
    maintain(now=T + timedelta(hours=2))  # computed while it seemed to run
    assert table() == {(gpu.pk, "09"): (3600.0, 0.0), (gpu.pk, "10"): (3600.0, 0.0)}

    # the agent, back after a disconnect, says at noon it ended at 09:30
    finish(node, attempt, T + timedelta(minutes=30), reported=NOW)
    with time_machine.travel(NOW, tick=False):
        assert GpuHourStale.objects.filter(since=T + timedelta(minutes=30)).exists()
        hours.maintain(NOW)

    assert table() == {(gpu.pk, "09"): (1800.0, 0.0)}


def test_samples_replayed_late_have_the_hours_computed_again(
    alice: User, node: Node
) -> None:
    attempt = begin(JobFactory(owner=alice), node, T)
    gpu = gpu_of(attempt)
    maintain(now=T + timedelta(hours=1))
    assert table() == {(gpu.pk, "09"): (3600.0, 0.0)}  # no samples: no evidence

    # the agent replays what it spooled while cut off, through the consumer's path
    from agents import protocol

    for i in range(360):
        metrics.store_samples(
            {gpu.index: gpu.pk},
            protocol.MetricsData(
                sampled_at=(T + i * STEP).timestamp(),
                gpus=[
                    protocol.GpuSample(
                        index=gpu.index,
                        uuid=gpu.uuid,
                        util_gpu=0.0,
                        memory_used_mib=20000,
                        processes=[
                            protocol.ProcessSample(
                                pid=9,
                                used_memory_mib=20000,
                                sm_util=0.0,
                                attempt_id=attempt.pk,
                            )
                        ],
                    )
                ],
            ),
            now=NOW,
        )
    with time_machine.travel(NOW, tick=False):
        hours.maintain(NOW)

    assert table()[gpu.pk, "09"] == (3600.0, 3600.0)


def test_hours_past_the_samples_kept_are_held_with_idle_unknown_and_keep_it(
    alice: User, node: Node
) -> None:
    old = T - timedelta(days=10)  # samples are kept 7 days
    attempt = begin(JobFactory(owner=alice), node, old)
    finish(node, attempt, old + timedelta(hours=1))
    gpu = gpu_of(attempt)

    maintain(since=old)
    assert table() == {(gpu.pk, "09"): (3600.0, None)}

    # an hour computed with its samples keeps its idle time when a late report
    # has it recomputed after they were dropped
    GpuHour.objects.filter(gpu=gpu).update(idle_seconds=120.0)
    maintain(since=old)
    assert table() == {(gpu.pk, "09"): (3600.0, 120.0)}


def test_the_migration_asks_for_a_backfill_of_the_overviews_days(
    alice: User, node: Node
) -> None:
    attempt = begin(JobFactory(owner=alice), node, NOW - timedelta(days=20))
    finish(node, attempt, NOW - timedelta(days=20) + timedelta(hours=2))
    GpuHourStale.objects.all().delete()
    migration = importlib.import_module("portal.accounting.migrations.0002_gpu_hours")

    with time_machine.travel(NOW, tick=False):
        migration.ask_for_backfill(django_apps, None)
        [mark] = GpuHourStale.objects.values_list("since", flat=True)
        assert mark == NOW - timedelta(days=31)
        hours.maintain(NOW)  # a day per chunk, well within a run's budget

    assert sum(GpuHour.objects.values_list("held_seconds", flat=True)) == 7200.0
