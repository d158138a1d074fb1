"""A node declared lost, then back: the agent's spooled start and exit of the
attempts the portal ended at the last heartbeat correct their times and their
charges (records, days, the GPU's neighbours), never the jobs' states again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from django.conf import settings

from portal.accounting.models import DailyUsage, GpuHourStale
from scheduler import policy, services
from scheduler.models import Allocation, Attempt, Job, JobEvent, Node, UsageRecord
from tests.accounting.test_charges import GIB, T0, charged, join
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, UTC)


def lose(node: Node, last_seen: float) -> None:
    """The node's last heartbeat at T0 + ``last_seen``; beat finds it lost (the
    other nodes' heartbeats are fresh)."""
    Node.objects.filter(pk=node.pk).update(last_seen_at=at(last_seen))
    later = at(last_seen + settings.GPULAB_NODE_LOST_AFTER + 5)
    Node.objects.exclude(pk=node.pk).update(last_seen_at=later)
    with time_machine.travel(later, tick=False):
        assert services.mark_lost_nodes() == [node.pk]


def back(node: Node) -> None:
    """The agent reconnects (hello, nothing running any more)."""
    from tests.accounting.test_charges import _hello_again

    services.record_hello(node.pk, _hello_again(node))


def report_exit(node: Node, attempt: Attempt, ended: float, **kw: Any) -> bool:
    """The agent replays its spooled exit a while later."""
    with time_machine.travel(at(ended + 3600), tick=False):
        return services.finish_attempt(
            node.pk, exited_data(attempt, kw.pop("code", 0), at=T0 + ended, **kw)
        )


def transitions(job: Job) -> list[tuple[str, str]]:
    return list(
        JobEvent.objects.filter(job=job)
        .exclude(to_status="")
        .values_list("from_status", "to_status")
    )


def test_a_job_that_finished_while_its_agent_was_cut_off_is_charged_to_its_exit(
    alice: User,
) -> None:
    node, _ = make_node("node-l", 1)
    other, _ = make_node("node-o", 1)
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    lose(node, last_seen=100)
    attempt.refresh_from_db()
    assert charged(attempt) == pytest.approx(100)  # up to the last heartbeat
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING  # requeued, once
    second = start_job(job, other)  # and running again elsewhere
    assert services.mark_started(other.pk, started_data(second, T0 + 200))
    before = transitions(job)

    back(node)
    assert report_exit(node, attempt, ended=500)

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.ended_at == at(500)
    assert attempt.outcome == Attempt.Outcome.NODE_LOST
    assert attempt.exit_code == 0
    assert charged(attempt) == pytest.approx(500)
    days = DailyUsage.objects.filter(record__attempt=attempt)
    assert sum(d.gpu_seconds for d in days) == pytest.approx(500)
    record = UsageRecord.objects.get(attempt=attempt)
    assert record.ended_at == at(500)
    assert set(Allocation.objects.filter(attempt=attempt).values_list(
        "released_at", flat=True)) == {at(500)}  # fmt: skip
    # the job was neither requeued again nor touched: attempt 2 runs on
    assert job.status == Job.Status.RUNNING
    assert transitions(job) == before
    assert Attempt.objects.get(pk=second.pk).ended_at is None
    note = JobEvent.objects.filter(job=job, message__contains="charged again").get()
    assert "0.028 -> 0.139 GPU-h" in note.message
    # the GPU hours computed meanwhile are looked at again from the old end
    assert GpuHourStale.objects.filter(since=at(100)).exists()

    # a replay of the same exit changes nothing
    assert not report_exit(node, attempt, ended=500)
    assert charged(attempt) == pytest.approx(500)
    assert JobEvent.objects.filter(job=job, message__contains="charged").count() == 1


def test_an_exit_before_the_last_heartbeat_shortens_the_charge(alice: User) -> None:
    node, _ = make_node("node-l", 1)
    attempt = start_job(JobFactory(owner=alice), node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    lose(node, last_seen=100)  # its exit at T0+50 never got through

    back(node)
    assert report_exit(node, attempt, ended=50, code=3)

    attempt.refresh_from_db()
    assert attempt.ended_at == at(50) and attempt.exit_code == 3
    assert charged(attempt) == pytest.approx(50)


def test_late_exits_on_a_shared_gpu_recharge_both_jobs_consistently(
    alice: User, bob: User
) -> None:
    node, _ = make_node("node-l", 1)
    gpu = node.gpus.get()
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=40 * GIB)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=40 * GIB)
    first = start_job(a, node)
    assert services.mark_started(node.pk, started_data(first, T0))
    second = join(b, gpu, node, a, T0)
    lose(node, last_seen=100)
    assert charged(first) == pytest.approx(50)
    assert charged(second) == pytest.approx(50)

    back(node)
    assert report_exit(node, second, ended=200)
    assert report_exit(node, first, ended=300)

    # 200 s shared half and half, then A alone for 100 s: the GPU's 300 s, once
    assert charged(first) == pytest.approx(100 + 100)
    assert charged(second) == pytest.approx(100)
    assert charged(first) + charged(second) == pytest.approx(300)


def test_a_start_and_an_exit_both_late_are_charged(alice: User) -> None:
    node, _ = make_node("node-l", 1)
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)  # STARTING: its start never got through
    lose(node, last_seen=5)
    attempt.refresh_from_db()
    assert attempt.started_at is None and charged(attempt) == 0
    job.refresh_from_db()
    status = job.status

    back(node)
    with time_machine.travel(at(4000), tick=False):
        assert services.mark_started(node.pk, started_data(attempt, T0 + 10))
        assert not services.mark_started(node.pk, started_data(attempt, T0 + 10))
    assert report_exit(node, attempt, ended=70)

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.started_at == at(10)
    assert charged(attempt) == pytest.approx(60)
    assert job.status == status


def test_a_job_across_nodes_ends_when_its_last_rank_reports(
    alice: User, cluster: list[Node]
) -> None:
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    start = policy.Start(
        job.pk,
        tuple(
            policy.Placement(n.pk, tuple(g.pk for g in n.gpus.order_by("index")))
            for n in (a, b)
        ),
    )
    assert services.apply_decisions([start]).started == 1
    attempt = Attempt.objects.get(job=job)
    assert services.mark_started(a.pk, started_data(attempt, T0))
    assert services.mark_started(b.pk, started_data(attempt, T0))
    lose(a, last_seen=100)  # rank 0's node; rank 1 is told to stop
    assert charged(attempt) == pytest.approx(6 * 100)

    # rank 1 (node-b, never cut off) stopped at T0+130; the estimate stands for
    # rank 0 meanwhile
    assert report_exit(b, attempt, ended=130, code=143, reason="killed")
    attempt.refresh_from_db()
    assert attempt.ended_at == at(130)
    # rank 0's agent, back, says it ran until T0+400
    back_a = _hello_for(a)
    services.record_hello(a.pk, back_a)
    assert report_exit(a, attempt, ended=400, code=0)

    attempt.refresh_from_db()
    assert attempt.ended_at == at(400)
    assert charged(attempt) == pytest.approx(6 * 400)


def _hello_for(node: Node) -> Any:
    from agents import protocol
    from tests.conftest import hello_data

    data = hello_data(node.gpus.count(), host=node.name).model_dump()
    for gpu, info in zip(node.gpus.order_by("index"), data["gpus"], strict=True):
        info["uuid"] = gpu.uuid
    return protocol.HelloData.model_validate({**data, "running": []})


def test_an_attempt_the_agent_ended_itself_is_never_corrected(alice: User) -> None:
    node, _ = make_node("node-l", 1)
    attempt = start_job(JobFactory(owner=alice), node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    assert report_exit(node, attempt, ended=100)

    assert not report_exit(node, attempt, ended=900)  # a bogus second exit

    attempt.refresh_from_db()
    assert attempt.ended_at == at(100)
    assert charged(attempt) == pytest.approx(100)


def test_the_corrected_end_is_after_the_recorded_start(alice: User) -> None:
    node, _ = make_node("node-l", 1)
    attempt = start_job(JobFactory(owner=alice), node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    lose(node, last_seen=100)

    back(node)
    assert report_exit(node, attempt, ended=-50)  # a clock gone wrong

    attempt.refresh_from_db()
    assert attempt.ended_at == at(0)
    assert charged(attempt) == 0
    assert timedelta(0) == attempt.ended_at - at(0)
