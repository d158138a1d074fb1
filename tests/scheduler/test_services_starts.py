"""A pass's starts applied together: a fixed number of queries, whatever the number
of jobs pending or started; a batch that fails falls back to one start at a time;
either way no GPU slot is held twice and every started job has one live attempt."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from scheduler import pass_runner, policy, services
from scheduler.models import Allocation, Attempt, Job, JobEvent
from tests.conftest import make_node
from tests.factories import JobFactory, free_gpus

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db


def assert_consistent() -> None:
    """No GPU slot held twice, no GPU held by two attempts; a starting job has
    exactly one live attempt, a pending one none."""
    live = list(Allocation.objects.filter(released_at__isnull=True))
    assert Counter((a.gpu_id, a.slot) for a in live).most_common(1)[0][1] == 1
    holders: dict[int, set[int]] = {}
    for a in live:
        holders.setdefault(a.gpu_id, set()).add(a.attempt_id)
    assert all(len(h) == 1 for h in holders.values()), holders
    for job in Job.objects.filter(status=Job.Status.STARTING):
        assert Attempt.objects.filter(job=job, ended_at__isnull=True).count() == 1
    assert not Attempt.objects.filter(
        job__status=Job.Status.PENDING, ended_at__isnull=True
    ).exists()


def one_gpu_starts(jobs: list[Job], node: Node) -> list[policy.Start]:
    gpus = free_gpus(node, len(jobs))
    return [
        policy.Start.on(job.pk, node.pk, (gpu.pk,))
        for job, gpu in zip(jobs, gpus, strict=True)
    ]


def queries_of_a_pass() -> tuple[int, dict[str, Any]]:
    with CaptureQueriesContext(connection) as ctx:
        result = pass_runner.run_one_pass()
    return len(ctx.captured_queries), result


@pytest.fixture
def busy_cluster(alice: User, sent: AgentFrames) -> None:
    """A node whose one GPU runs a job (so every pass measured has running jobs)."""
    make_node("node-0", 1)
    JobFactory(owner=alice)
    assert pass_runner.run_one_pass()["started"] == 1


# ------------------------------------------------------------------ query counts


def test_a_pass_costs_the_same_queries_for_10_or_50_pending_jobs(
    alice: User, busy_cluster: None
) -> None:
    make_node("node-a", 4)
    for _ in range(10):
        JobFactory(owner=alice)
    few, first = queries_of_a_pass()
    make_node("node-b", 4)
    for _ in range(50):
        JobFactory(owner=alice)

    many, second = queries_of_a_pass()

    assert (first["pending"], first["started"]) == (10, 4)
    assert (second["pending"], second["started"]) == (56, 4)
    assert many == few


def test_a_pass_costs_the_same_queries_for_2_or_12_starts(
    alice: User, busy_cluster: None
) -> None:
    make_node("node-a", 2)
    for _ in range(20):
        JobFactory(owner=alice)
    few, first = queries_of_a_pass()
    make_node("node-b", 12)

    many, second = queries_of_a_pass()

    assert (first["started"], second["started"]) == (2, 12)
    assert many == few
    assert_consistent()


# ------------------------------------------------------------------ batched path


def test_it_starts_every_job_of_the_batch_with_its_attempt_allocations_and_event(
    alice: User, sent: AgentFrames, django_capture_on_commit_callbacks: Any
) -> None:
    node, _ = make_node("node-a", 8)
    jobs = [JobFactory(owner=alice) for _ in range(5)]

    with django_capture_on_commit_callbacks(execute=True):
        result = services.apply_decisions(one_gpu_starts(jobs, node))

    assert (result.started, result.skipped) == (5, 0)
    for job in jobs:
        job.refresh_from_db()
        assert (job.status, job.attempts, job.pending_reason) == ("starting", 1, "")
        [attempt] = Attempt.objects.filter(job=job)
        assert (attempt.number, attempt.node_id) == (1, node.pk)
        assert attempt.allocations.count() == 2  # both slots of its GPU
        assert JobEvent.objects.filter(job=job, to_status="starting").count() == 1
    assert sorted(f["data"]["job_id"] for f in sent.frames()) == sorted(
        j.pk for j in jobs
    )
    assert_consistent()


def test_it_skips_the_starts_whose_job_or_gpu_changed_and_starts_the_rest(
    alice: User, sent: AgentFrames
) -> None:
    node, _ = make_node("node-a", 4)
    gpus = free_gpus(node, 4)
    cancelled, taken, twice, fine, again = (JobFactory(owner=alice) for _ in range(5))
    services.cancel_job(cancelled.pk, by=alice)
    holder = JobFactory(owner=alice)
    services.apply_decisions([policy.Start.on(holder.pk, node.pk, (gpus[1].pk,))])

    result = services.apply_decisions(
        [
            policy.Start.on(cancelled.pk, node.pk, (gpus[0].pk,)),
            policy.Start.on(taken.pk, node.pk, (gpus[1].pk,)),  # held by `holder`
            policy.Start.on(fine.pk, node.pk, (gpus[2].pk,)),
            policy.Start.on(twice.pk, node.pk, (gpus[2].pk,)),  # given to `fine`
            policy.Start.on(fine.pk, node.pk, (gpus[3].pk,)),  # a job starts once
            policy.Start.on(again.pk, node.pk, (gpus[3].pk,)),
        ]
    )

    assert (result.started, result.skipped) == (2, 4)
    statuses = {
        j.pk: j.status
        for j in Job.objects.filter(pk__in=[cancelled.pk, taken.pk, twice.pk])
    }
    assert statuses == {
        cancelled.pk: "cancelled",
        taken.pk: "pending",
        twice.pk: "pending",
    }
    assert Attempt.objects.get(job=fine).allocations.first().gpu_id == gpus[2].pk
    assert Attempt.objects.get(job=again).allocations.first().gpu_id == gpus[3].pk
    assert_consistent()


def test_it_starts_a_job_spanning_nodes_in_a_batch(
    alice: User, sent: AgentFrames
) -> None:
    a, _ = make_node("node-a", 4)
    b, _ = make_node("node-b", 2)
    wide = JobFactory(owner=alice, gpus=5)
    small = JobFactory(owner=alice)
    [b_last] = free_gpus(b, 2)[1:]

    result = services.apply_decisions(
        [
            policy.Start(
                wide.pk,
                (
                    policy.Placement(a.pk, tuple(g.pk for g in free_gpus(a, 4))),
                    policy.Placement(b.pk, (free_gpus(b, 1)[0].pk,)),
                ),
            ),
            policy.Start.on(small.pk, b.pk, (b_last.pk,)),
        ]
    )

    assert result.started == 2
    attempt = Attempt.objects.get(job=wide)
    assert attempt.ranks == [a.pk, b.pk]
    assert attempt.allocations.values("gpu_id").distinct().count() == 5
    assert_consistent()


# ------------------------------------------------------------------ fallback


def test_a_batch_that_breaks_a_constraint_starts_its_jobs_one_at_a_time(
    alice: User, sent: AgentFrames
) -> None:
    node, _ = make_node("node-a", 4)
    jobs = [JobFactory(owner=alice) for _ in range(4)]
    # An inconsistent row (a pending job with a live attempt): inserting its new
    # attempt breaks scheduler_attempt_one_live_per_job, as a slot taken by a
    # concurrent pass breaks scheduler_allocation_one_job_per_slot.
    stale = Attempt.objects.create(
        job=jobs[1], number=7, node=node, created_at=timezone.now()
    )

    result = services.apply_decisions(one_gpu_starts(jobs, node))

    assert (result.started, result.skipped) == (3, 1)
    statuses = [Job.objects.get(pk=j.pk).status for j in jobs]
    assert statuses == ["starting", "pending", "starting", "starting"]
    assert list(Attempt.objects.filter(job=jobs[1])) == [stale]
    assert not Allocation.objects.filter(attempt=stale).exists()
    assert Allocation.objects.filter(released_at__isnull=True).count() == 3 * 2


def test_an_unlaunchable_job_fails_alone_and_the_others_of_its_batch_start(
    alice: User, sent: AgentFrames, django_capture_on_commit_callbacks: Any
) -> None:
    node, _ = make_node("node-a", 4)
    jobs = [JobFactory(owner=alice) for _ in range(3)]
    # Longer than any launch frame may carry (stored around submit's validation).
    Job.objects.filter(pk=jobs[0].pk).update(command="x" * (300 * 1024))

    with django_capture_on_commit_callbacks(execute=True):
        result = services.apply_decisions(one_gpu_starts(jobs, node))

    assert (result.started, result.skipped) == (2, 1)
    failed = Job.objects.get(pk=jobs[0].pk)
    assert failed.status == Job.Status.FAILED
    assert failed.end_reason.startswith("cannot be launched")
    assert not Attempt.objects.filter(job=failed).exists()
    assert {f["data"]["job_id"] for f in sent.frames()} == {
        jobs[1].pk,
        jobs[2].pk,
    }
    assert_consistent()
