"""Accounting invariants, through the services an agent's reports call: the charges
over a GPU add up to the time it ran something, split by declared memory or equally,
by UTC day, per attempt across preemption, and whatever order late reports come in.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection

from portal.accounting.models import DailyUsage
from scheduler import metrics, services
from scheduler.models import Attempt, Job, UsageRecord
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

    from scheduler.models import Gpu, Node

pytestmark = pytest.mark.django_db

GIB = 1024
# 2027-01-15 08:00 UTC: an agent clock far from the test's wall clock.
T0 = 1_800_000_000.0


def run_alone(job: Job, node: Node, start: float) -> Attempt:
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt, start))
    return attempt


def join(job: Job, gpu: Gpu, node: Node, partner: Job, start: float) -> Attempt:
    result = services.apply_decisions(
        [shared_start(job, gpu.pk, node.pk, (partner.pk,))]
    )
    assert result.started == 1
    attempt = Attempt.objects.get(job=job, ended_at__isnull=True)
    assert services.mark_started(node.pk, started_data(attempt, start))
    return attempt


def end(node: Node, attempt: Attempt, at: float, **kw: Any) -> None:
    assert services.finish_attempt(node.pk, exited_data(attempt, 0, at=at, **kw))


def charged(attempt: Attempt) -> float:
    return sum(r.gpu_seconds for r in UsageRecord.objects.filter(attempt=attempt))


def pair(alice: User, bob: User, mib_a: int | None, mib_b: int | None) -> Any:
    """One 80 GiB GPU: alice's job A runs from T0, bob's B joins at T0+100."""
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=mib_a)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=mib_b)
    first = run_alone(a, node, T0)
    second = join(b, gpu, node, a, T0 + 100)
    return node, gpu, first, second


def test_a_shared_gpu_is_charged_by_declared_memory(alice: User, bob: User) -> None:
    node, _, first, second = pair(alice, bob, 20 * GIB, 60 * GIB)

    end(node, first, T0 + 300)
    end(node, second, T0 + 400)

    # A: 100 s alone + 200 s at 20/80; B: 200 s at 60/80 + 100 s alone
    assert charged(first) == pytest.approx(100 + 200 * 0.25)
    assert charged(second) == pytest.approx(200 * 0.75 + 100)
    assert charged(first) + charged(second) == pytest.approx(400)  # the GPU's time
    record = UsageRecord.objects.get(attempt=first)
    assert record.share == pytest.approx(150 / 300)


def test_a_shared_gpu_is_charged_equally_when_set(
    settings: Any, alice: User, bob: User
) -> None:
    settings.GPULAB_SHARED_CHARGE = "equal"
    node, _, first, second = pair(alice, bob, 20 * GIB, 60 * GIB)

    end(node, first, T0 + 300)
    end(node, second, T0 + 400)

    assert charged(first) == pytest.approx(100 + 100)
    assert charged(second) == pytest.approx(100 + 100)


def test_a_job_without_a_declaration_counts_as_the_whole_gpu(
    alice: User, bob: User
) -> None:
    node, _, first, second = pair(alice, bob, None, 16 * GIB)

    end(node, first, T0 + 300)
    end(node, second, T0 + 400)

    # weights 80 GiB and 16 GiB while they share
    assert charged(first) == pytest.approx(100 + 200 * 80 / 96)
    assert charged(first) + charged(second) == pytest.approx(400)


@pytest.mark.parametrize("second_reported_first", [False, True])
def test_late_exits_replayed_after_a_reconnect_are_charged_from_agent_times(
    alice: User, bob: User, *, second_reported_first: bool
) -> None:
    node, _, first, second = pair(alice, bob, 40 * GIB, 40 * GIB)
    services.record_disconnect(node.pk)
    # Both exit while the agent is cut off; it says hello again with neither
    # running, then replays the exits (in either order: charges must not care).
    hello = services.record_hello(node.pk, _hello_again(node))
    assert not [c for c in hello.commands if c["type"] == "job.kill"]
    order = [(second, T0 + 250), (first, T0 + 200)]
    if not second_reported_first:
        order.reverse()
    for attempt, at in order:
        end(node, attempt, at)

    assert charged(first) == pytest.approx(100 + 100 * 0.5)
    assert charged(second) == pytest.approx(100 * 0.5 + 50)
    assert charged(first) + charged(second) == pytest.approx(250)


def _hello_again(node: Node) -> Any:
    """The node's hello after a reconnect: its GPU, no attempt running."""
    from agents import protocol
    from tests.conftest import hello_data

    data = hello_data(1, host=node.name).model_dump()
    data["gpus"][0]["uuid"] = node.gpus.get().uuid
    return protocol.HelloData.model_validate({**data, "running": []})


def test_a_start_reported_after_its_partner_ended_recharges_the_partner(
    alice: User, bob: User
) -> None:
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=40 * GIB)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=40 * GIB)
    first = run_alone(a, node, T0)
    result = services.apply_decisions([shared_start(b, gpu.pk, node.pk, (a.pk,))])
    assert result.started == 1
    second = Attempt.objects.get(job=b)
    end(node, first, T0 + 200)  # charged alone so far: 200 s
    assert charged(first) == pytest.approx(200)

    # B's start (at T0+100, before A ended) arrives late
    assert services.mark_started(node.pk, started_data(second, T0 + 100))
    end(node, second, T0 + 300)

    assert charged(first) == pytest.approx(100 + 50)
    assert charged(second) == pytest.approx(50 + 100)


def test_an_attempt_spanning_midnight_is_charged_to_each_utc_day(
    alice: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    start = datetime(2027, 3, 1, 23, 0, tzinfo=UTC).timestamp()
    attempt = run_alone(JobFactory(owner=alice, gpus=2), node, start)

    end(node, attempt, start + 3 * 3600)

    assert DailyUsage.objects.filter(record__attempt=attempt).count() == 4
    per_day: dict[date, float] = {}
    for d in DailyUsage.objects.filter(record__attempt=attempt):
        per_day[d.day] = per_day.get(d.day, 0.0) + d.gpu_seconds
    assert per_day == {
        date(2027, 3, 1): pytest.approx(2 * 3600),
        date(2027, 3, 2): pytest.approx(2 * 7200),
    }
    assert charged(attempt) == pytest.approx(2 * 3 * 3600)


def test_a_preempted_and_requeued_job_is_charged_for_each_attempts_kept_work(
    alice: User, cluster: list[Node]
) -> None:
    # Not checkpointable: the preempted attempt's whole run is lost work, charged
    # to nobody (kept apart on its record); the next attempt is charged as usual.
    node = cluster[0]
    job = JobFactory(owner=alice)
    first = run_alone(job, node, T0)
    Attempt.objects.filter(pk=first.pk).update(kill_reason="preempted")
    end(node, first, T0 + 100, reason="killed")
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING

    second = run_alone(job, node, T0 + 500)
    end(node, second, T0 + 800)

    assert charged(first) == 0
    assert UsageRecord.objects.get(attempt=first).lost_gpu_seconds == pytest.approx(100)
    assert charged(second) == pytest.approx(300)
    assert UsageRecord.objects.get(attempt=second).lost_gpu_seconds == 0
    assert UsageRecord.objects.filter(attempt__job=job).count() == 2


def test_energy_is_the_counter_delta_over_the_run_split_by_share(
    alice: User, bob: User
) -> None:
    node, gpu, first, second = pair(alice, bob, 20 * GIB, 60 * GIB)
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, datetime.fromtimestamp(T0, UTC))
    # 300 W, sampled every 10 s from T0 to T0+400, 50 % busy
    rows = [
        (gpu.pk, datetime.fromtimestamp(T0 + s, UTC), 50.0, None, None, None,
         300.0, None, None, None, None, 1_000_000 + 300_000 * s, False, "[]")
        for s in range(0, 401, 10)
    ]  # fmt: skip
    insert_samples(rows)

    end(node, first, T0 + 300)
    end(node, second, T0 + 400)

    record = UsageRecord.objects.get(attempt=first)
    assert record.energy_j == pytest.approx(300 * 300 * record.share)
    assert record.util_gpu_mean == pytest.approx(50.0)
    total = sum(r.energy_j or 0 for r in UsageRecord.objects.filter(gpu=gpu))
    # A's window and B's window overlap, but by share the GPU's energy over the
    # first 400 s is charged once: 100 s of A alone, 300 s after.
    assert total == pytest.approx(300 * 300 * (150 / 300) + 300 * 300 * (250 / 300))
    busy = sum(d.busy_gpu_seconds or 0 for d in DailyUsage.objects.all())
    assert busy == pytest.approx(0.5 * 400)


def test_a_job_never_started_is_not_charged(alice: User, cluster: list[Node]) -> None:
    node = cluster[0]
    attempt = start_job(JobFactory(owner=alice), node)

    services.finish_attempt(
        node.pk, exited_data(attempt, None, at=T0, reason="never_started")
    )

    assert not UsageRecord.objects.exists()
    assert not DailyUsage.objects.exists()
