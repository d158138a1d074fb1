"""Idle detection rules on real PostgreSQL: own processes only, memory held at 0 %
SM is idle, gaps are no evidence, young jobs never idle, re-activation clears the
flag, a cancel-class job is cancelled after the grace (time-machine)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from portal.idle import detect
from portal.idle.models import IdleFlag
from portal.idle.rules import all_rules
from portal.notifications.models import Delivery, Kind
from scheduler import metrics, services
from scheduler.models import Attempt, Job, JobEvent
from tests.conftest import make_node
from tests.factories import JobFactory, shared_start, start_job, started_data
from tests.samples import insert_samples

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Gpu, Node

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
STEP = timedelta(seconds=10)  # GPULAB_METRICS_PERSIST_INTERVAL's default


@pytest.fixture
def node(db: None) -> Node:
    # The samples are at the fixed NOW: its daily partitions must exist whatever
    # today is (migrations make them around the real date only).
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, NOW)
    return make_node("idle-node", 2)[0]


def run(
    owner: User,
    node: Node,
    *,
    started: datetime,
    gpus: int = 1,
    gpu_list: list[Gpu] | None = None,
    klass: str = "normal",
) -> Attempt:
    """A RUNNING job whose agent reported its start at ``started``."""
    job = JobFactory(owner=owner, gpus=gpus, priority_class=klass)
    attempt = start_job(job, node, gpu_list)
    with time_machine.travel(started, tick=False):
        assert services.mark_started(
            node.pk, started_data(attempt, started.timestamp())
        )
    attempt.refresh_from_db()
    return attempt


def sample(
    gpu: Gpu,
    at: datetime,
    procs: list[dict[str, Any]],
    util_gpu: float | None = None,
    *,
    lost: bool = False,
) -> None:
    if util_gpu is None:
        util_gpu = min(100.0, sum(p.get("sm_util") or 0 for p in procs))
    insert_samples([(gpu.pk, at, util_gpu, *[None] * 9, lost, json.dumps(procs))])


def proc(
    attempt: Attempt | None, sm: float | None, mem: int = 20000, pid: int = 100
) -> dict[str, Any]:
    return {
        "pid": pid,
        "used_memory_mib": mem,
        "sm_util": sm,
        "attempt_id": attempt.pk if attempt else None,
    }


def series(gpu: Gpu, start: datetime, end: datetime, make: Any) -> None:
    at = start
    while at <= end:
        sample(gpu, at, make(at))
        at += STEP


def gpu_of(attempt: Attempt) -> Gpu:
    return attempt.allocations.select_related("gpu").first().gpu  # type: ignore[union-attr]


def open_flag(attempt: Attempt) -> IdleFlag | None:
    return IdleFlag.objects.filter(attempt=attempt, cleared_at__isnull=True).first()


def test_memory_held_at_zero_sm_for_the_window_is_flagged_with_figures(
    alice: User, node: Node, django_capture_on_commit_callbacks: Any
) -> None:
    attempt = run(alice, node, started=NOW - timedelta(minutes=45))
    gpu = gpu_of(attempt)
    since = NOW - timedelta(minutes=31)
    series(gpu, since, NOW, lambda at: [proc(attempt, 0, mem=20000)])

    with django_capture_on_commit_callbacks() as callbacks:
        result = detect.check(NOW)

    assert result.flagged == [attempt.job_id]
    flag = open_flag(attempt)
    assert flag is not None
    assert flag.since == since
    assert (flag.util_max, flag.memory_mib, flag.gpus) == (0.0, 20000, 1)
    assert flag.action == "notify" and flag.cancel_at is None
    event = JobEvent.objects.filter(
        job_id=attempt.job_id, message__startswith="flagged idle"
    )
    assert event.count() == 1
    assert "20,000 MiB" in event.get().message
    notice = Delivery.objects.get(kind=Kind.IDLE_WARNING)
    assert notice.user_id == alice.pk and notice.payload["job_id"] == attempt.job_id
    assert notice.channel == Delivery.Channel.EMAIL
    assert len(callbacks) >= 1  # the delivery is enqueued on commit
    # A second check keeps the one flag (no second event or notification).
    detect.check(NOW + STEP)
    assert IdleFlag.objects.count() == 1
    assert Delivery.objects.filter(kind=Kind.IDLE_WARNING).count() == 1


def test_a_busy_job_is_not_flagged(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    series(
        gpu_of(attempt),
        NOW - timedelta(minutes=40),
        NOW,
        lambda at: [proc(attempt, 80)],
    )

    assert detect.check(NOW).flagged == []


def test_one_busy_sample_in_the_window_restarts_the_idle_run(
    alice: User, node: Node
) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    busy = NOW - timedelta(minutes=10)
    series(
        gpu_of(attempt),
        NOW - timedelta(minutes=40),
        NOW,
        lambda at: [proc(attempt, 50 if at == busy else 1)],
    )

    assert detect.check(NOW).flagged == []
    assert (
        detect.check(busy + timedelta(minutes=30, seconds=10)).flagged == []
    )  # no samples: stale
    assert open_flag(attempt) is None


def test_a_job_younger_than_the_window_is_never_idle(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(minutes=29))
    series(
        gpu_of(attempt), NOW - timedelta(minutes=29), NOW, lambda at: [proc(attempt, 0)]
    )
    # Samples from before its start (another job's, on the same GPU) do not count.
    series(
        gpu_of(attempt),
        NOW - timedelta(minutes=40),
        NOW - timedelta(minutes=30),
        lambda at: [],
    )

    assert detect.check(NOW).flagged == []


def test_only_the_jobs_own_processes_count_on_a_shared_gpu(
    alice: User, bob: User, node: Node
) -> None:
    gpu = node.gpus.get(index=0)
    first = JobFactory(owner=alice, shareable=True)
    idle = start_job(first, node, [gpu])
    second = JobFactory(owner=bob, shareable=True)
    assert (
        services.apply_decisions(
            [shared_start(second, gpu.pk, node.pk, (first.pk,))]
        ).started
        == 1
    )
    busy = Attempt.objects.get(job=second)
    started = (NOW - timedelta(hours=1)).timestamp()
    for attempt in (idle, busy):
        assert services.mark_started(node.pk, started_data(attempt, started))
    # The GPU is 90 % busy, all of it bob's; alice's process holds memory only.
    series(
        gpu,
        NOW - timedelta(minutes=40),
        NOW,
        lambda at: [proc(idle, 0, pid=1), proc(busy, 90, pid=2)],
    )

    assert detect.check(NOW).flagged == [idle.job_id]
    assert open_flag(busy) is None


def test_a_sample_gap_is_no_evidence(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=2))
    gpu = gpu_of(attempt)
    # Idle for 40 min, but the agent was cut off for 5 min 20 min ago.
    gap = (NOW - timedelta(minutes=25), NOW - timedelta(minutes=20))
    series(gpu, NOW - timedelta(minutes=40), gap[0], lambda at: [proc(attempt, 0)])
    series(gpu, gap[1], NOW, lambda at: [proc(attempt, 0)])

    assert detect.check(NOW).flagged == []
    # The evidence after the gap counts once it spans the window by itself.
    later = gap[1] + timedelta(minutes=30)
    series(gpu, NOW + STEP, later, lambda at: [proc(attempt, 0)])
    assert detect.check(later).flagged == [attempt.job_id]
    assert open_flag(attempt).since == gap[1]  # type: ignore[union-attr]


def test_stale_samples_are_no_evidence(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=2))
    series(
        gpu_of(attempt),
        NOW - timedelta(minutes=40),
        NOW - timedelta(minutes=5),
        lambda at: [proc(attempt, 0)],
    )

    assert detect.check(NOW).flagged == []


def test_every_gpu_of_the_job_must_be_idle(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1), gpus=2)
    g0, g1 = (
        a.gpu
        for a in attempt.allocations.select_related("gpu")
        .order_by("gpu__index")
        .distinct("gpu__index")
    )
    series(g0, NOW - timedelta(minutes=40), NOW, lambda at: [proc(attempt, 0)])
    series(g1, NOW - timedelta(minutes=40), NOW, lambda at: [proc(attempt, 70)])

    assert detect.check(NOW).flagged == []


def test_without_per_process_readings_the_whole_gpu_stands_in(
    alice: User, node: Node
) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    gpu = gpu_of(attempt)
    series(
        gpu, NOW - timedelta(minutes=40), NOW, lambda at: [proc(attempt, None)]
    )  # NVML gave no per-process SM
    # util_gpu is the sum of known sm_util (0) here: idle.
    assert detect.check(NOW).flagged == [attempt.job_id]


def test_unknown_readings_with_a_busy_gpu_are_not_idle(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    gpu = gpu_of(attempt)
    at = NOW - timedelta(minutes=40)
    while at <= NOW:
        sample(gpu, at, [proc(attempt, None)], util_gpu=60)
        at += STEP

    assert detect.check(NOW).flagged == []


def test_activity_clears_the_flag_with_an_event(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    gpu = gpu_of(attempt)
    series(gpu, NOW - timedelta(minutes=31), NOW, lambda at: [proc(attempt, 0)])
    assert detect.check(NOW).flagged == [attempt.job_id]

    sample(gpu, NOW + STEP, [proc(attempt, 75)])
    result = detect.check(NOW + STEP)

    assert result.cleared == [attempt.job_id]
    flag = IdleFlag.objects.get(attempt=attempt)
    assert flag.cleared == IdleFlag.Cleared.ACTIVE and flag.cleared_at is not None
    assert JobEvent.objects.filter(
        job_id=attempt.job_id, message__startswith="active again"
    ).exists()


def cancel_class(settings: Any, grace: int = 600) -> None:
    settings.GPULAB_PRIORITY_CLASSES = {
        **settings.GPULAB_PRIORITY_CLASSES,
        "best-effort": {
            **settings.GPULAB_PRIORITY_CLASSES["best-effort"],
            "idle_action": "cancel",
            "idle_grace": grace,
        },
    }


def test_a_cancel_class_job_still_idle_after_the_grace_is_cancelled(
    alice: User, node: Node, settings: Any
) -> None:
    cancel_class(settings, grace=600)
    attempt = run(alice, node, started=NOW - timedelta(hours=1), klass="best-effort")
    gpu = gpu_of(attempt)
    series(
        gpu,
        NOW - timedelta(minutes=31),
        NOW + timedelta(minutes=11),
        lambda at: [proc(attempt, 0)],
    )

    with time_machine.travel(NOW, tick=False):
        assert detect.check().flagged == [attempt.job_id]
    flag = open_flag(attempt)
    assert flag is not None and flag.cancel_at == NOW + timedelta(minutes=10)
    with time_machine.travel(NOW + timedelta(minutes=9, seconds=50), tick=False):
        assert detect.check().cancelled == []
    assert Job.objects.get(pk=attempt.job_id).cancel_requested_at is None

    with time_machine.travel(NOW + timedelta(minutes=10), tick=False):
        assert detect.check().cancelled == [attempt.job_id]

    job = Job.objects.get(pk=attempt.job_id)
    assert job.cancel_requested_at == NOW + timedelta(minutes=10)
    attempt.refresh_from_db()
    assert attempt.kill_reason == "cancelled"
    event = JobEvent.objects.filter(
        job=job, message__startswith="cancel requested by gpulab (idle"
    )
    assert event.get().source == JobEvent.Source.SYSTEM
    flag.refresh_from_db()
    assert flag.cleared == IdleFlag.Cleared.CANCELLED
    # Being cancelled, it is not flagged again while its process stops.
    with time_machine.travel(NOW + timedelta(minutes=11), tick=False):
        assert detect.check().flagged == []


def test_a_cancel_class_job_active_again_during_the_grace_is_kept(
    alice: User, node: Node, settings: Any
) -> None:
    cancel_class(settings, grace=600)
    attempt = run(alice, node, started=NOW - timedelta(hours=1), klass="best-effort")
    gpu = gpu_of(attempt)
    series(gpu, NOW - timedelta(minutes=31), NOW, lambda at: [proc(attempt, 0)])
    with time_machine.travel(NOW, tick=False):
        assert detect.check().flagged == [attempt.job_id]
    series(gpu, NOW + STEP, NOW + timedelta(minutes=11), lambda at: [proc(attempt, 40)])

    with time_machine.travel(NOW + timedelta(minutes=11), tick=False):
        result = detect.check()

    assert result.cancelled == [] and result.cleared == [attempt.job_id]
    assert Job.objects.get(pk=attempt.job_id).cancel_requested_at is None


def test_the_flag_closes_when_the_attempt_ends(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    series(
        gpu_of(attempt), NOW - timedelta(minutes=31), NOW, lambda at: [proc(attempt, 0)]
    )
    detect.check(NOW)
    from tests.factories import exited_data

    assert services.finish_attempt(node.pk, exited_data(attempt, 0, at=NOW.timestamp()))

    assert detect.check(NOW + STEP).ended == 1
    assert IdleFlag.objects.get(attempt=attempt).cleared == IdleFlag.Cleared.ENDED


def test_per_class_thresholds_apply(alice: User, node: Node, settings: Any) -> None:
    settings.GPULAB_PRIORITY_CLASSES = {
        **settings.GPULAB_PRIORITY_CLASSES,
        "normal": {
            **settings.GPULAB_PRIORITY_CLASSES["normal"],
            "idle_threshold": 20,
            "idle_window": 600,
        },
    }
    attempt = run(alice, node, started=NOW - timedelta(minutes=15))
    series(
        gpu_of(attempt),
        NOW - timedelta(minutes=11),
        NOW,
        lambda at: [proc(attempt, 15)],
    )

    assert detect.check(NOW).flagged == [attempt.job_id]
    assert open_flag(attempt).threshold == 20  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("idle_threshold", 150, "['idle_threshold']=150 must be from 0 to 100"),
        ("idle_threshold", "5%", "['idle_threshold']='5%' is not a number"),
        ("idle_window", 5, "['idle_window']=5 must be at least twice"),
        ("idle_grace", -1, "['idle_grace']=-1 must be at least 0"),
        ("idle_action", "kill", "['idle_action']='kill' is not one of: notify, cancel"),
    ],
)
def test_a_bad_class_idle_setting_is_named(
    settings: Any, key: str, value: Any, message: str
) -> None:
    settings.GPULAB_PRIORITY_CLASSES = {
        **settings.GPULAB_PRIORITY_CLASSES,
        "normal": {**settings.GPULAB_PRIORITY_CLASSES["normal"], key: value},
    }
    with pytest.raises(ImproperlyConfigured) as err:
        all_rules()
    assert "GPULAB_PRIORITY_CLASSES['normal']" + message in str(err.value)


def test_a_bad_default_threshold_is_named(settings: Any) -> None:
    settings.GPULAB_IDLE_THRESHOLD = 101.0
    with pytest.raises(
        ImproperlyConfigured, match=r"GPULAB_IDLE_THRESHOLD=101\.0 must be"
    ):
        all_rules()
