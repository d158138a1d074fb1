"""What a pass reads (``services.snapshot``): the policy's input in the models'
orders, running attempts' fair-share usage, and the waiting jobs' stored reasons,
which ``apply_decisions`` compares with the new ones instead of reading them again."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from scheduler import pass_runner, policy, services
from scheduler.models import Gpu, Job
from tests.conftest import make_node
from tests.factories import JobFactory, shared_start, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db


def test_the_snapshot_lists_jobs_and_gpus_in_the_models_orders(
    alice: User, bob: User
) -> None:
    b, _ = make_node("node-b", 2)
    a, _ = make_node("node-a", 3)
    for i in range(4):
        JobFactory(owner=alice if i % 2 else bob)
    first, second = JobFactory(owner=alice), JobFactory(owner=bob)
    start_job(second, a)
    start_job(first, b)

    state = services.cluster_state()

    assert [p.id for p in state.pending] == list(
        Job.objects.pending().values_list("pk", flat=True)
    )
    assert [p.user for p in state.pending][:2] == ["alice", "bob"]
    assert [g.id for g in state.gpus] == list(Gpu.objects.values_list("pk", flat=True))
    assert [r.id for r in state.running] == [first.pk, second.pk]
    assert [(r.user, r.group) for r in state.running] == [
        ("alice", first.group.name),
        ("bob", second.group.name),
    ]


def test_running_attempts_count_toward_fair_share_as_they_run(
    alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice, gpus=2)
    attempt = start_job(job, cluster[0])
    services.mark_started(cluster[0].pk, started_data(attempt, time.time() - 100))
    JobFactory(owner=alice)  # started, never ran: charged nothing
    start_job(Job.objects.pending().get(), cluster[1])

    usage = services.cluster_state().usage

    # 2 GPUs, each all its own, for 100 s.
    assert usage.group_usage[job.group.name] == pytest.approx(200, abs=2)
    assert usage.user_usage[job.group.name, "alice"] == pytest.approx(200, abs=2)


def test_running_jobs_sharing_a_gpu_count_toward_fair_share_by_the_charging_rule(
    alice: User, charlie: User
) -> None:
    """By declared memory (GPULAB_SHARED_CHARGE=memory), as their usage records
    will be charged, with the GPU's earlier neighbour taken into account."""
    node, _ = make_node("node-s", 1)
    gpu = node.gpus.get()
    now = time.time()
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=20 * 1024)
    first = start_job(a, node)
    services.mark_started(node.pk, started_data(first, now - 400))
    b = JobFactory(owner=charlie, shareable=True, gpu_memory_mib=60 * 1024)
    services.apply_decisions([shared_start(b, gpu.pk, node.pk, (a.pk,))])
    second = b.attempt_set.get()
    services.mark_started(node.pk, started_data(second, now - 200))

    usage = services.cluster_state().usage

    # alice: 200 s alone + 200 s at 20/80; charlie: 200 s at 60/80 (by live
    # slots they would have been 400 / 2 and 200 / 2)
    assert usage.user_usage[a.group.name, "alice"] == pytest.approx(250, abs=2)
    assert usage.user_usage[b.group.name, "charlie"] == pytest.approx(150, abs=2)
    assert usage.group_usage[b.group.name] == pytest.approx(150, abs=2)


def test_the_snapshot_reads_a_fixed_number_of_queries_whatever_runs(
    alice: User, cluster: list[Node]
) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            services.snapshot()
        return len(ctx.captured_queries)

    attempt = start_job(JobFactory(owner=alice), cluster[0])
    services.mark_started(cluster[0].pk, started_data(attempt, time.time() - 60))
    one = queries()
    for node in (cluster[0], cluster[0], cluster[1]):
        attempt = start_job(JobFactory(owner=alice), node)
        services.mark_started(node.pk, started_data(attempt, time.time() - 30))
    assert queries() == one


def test_a_pass_stores_only_the_reasons_that_changed(
    alice: User, cluster: list[Node]
) -> None:
    waiting = [JobFactory(owner=alice, gpus=6) for _ in range(3)]  # never fit now
    start_job(JobFactory(owner=alice), cluster[0])

    first = pass_runner.run_one_pass()
    again = pass_runner.run_one_pass()
    Job.objects.filter(pk=waiting[1].pk).update(pending_message="stale")
    third = pass_runner.run_one_pass()

    assert (first["reasons_updated"], again["reasons_updated"]) == (3, 0)
    assert third["reasons_updated"] == 1
    assert Job.objects.get(pk=waiting[1].pk).pending_message != "stale"


def test_a_job_that_left_pending_after_the_snapshot_keeps_its_fields(
    alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice)
    snap = services.snapshot()
    services.cancel_job(job.pk, by=alice)

    result = services.apply_decisions(
        [policy.Wait(job.pk, policy.Reason.RESOURCES, "late")], snap.stored_waits
    )

    job.refresh_from_db()
    assert result.updated_reasons == 0
    assert (job.status, job.pending_message) == ("cancelled", "")


@pytest.mark.django_db(transaction=True)
def test_storing_waits_skips_a_job_another_transaction_holds(
    alice: User, cluster: list[Node]
) -> None:
    """A concurrent pass holding a job (starting it) must not make this pass wait
    on it: waiting on rows in no set order deadlocked two racing passes."""
    held, free = JobFactory(owner=alice), JobFactory(owner=alice)
    snap = services.snapshot()
    locked = threading.Event()
    release = threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=held.pk)
                locked.set()
                release.wait(timeout=60)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(timeout=30)
        result = services.apply_decisions(
            [
                policy.Wait(held.pk, policy.Reason.RESOURCES, "for the held job"),
                policy.Wait(free.pk, policy.Reason.RESOURCES, "for the free job"),
            ],
            snap.stored_waits,
        )
    finally:
        release.set()
        holder.join(timeout=30)
    assert result.updated_reasons == 1
    assert Job.objects.get(pk=free.pk).pending_message == "for the free job"
    assert Job.objects.get(pk=held.pk).pending_message != "for the held job"


def test_the_snapshot_gives_the_policy_what_co_location_reads(alice: User) -> None:
    node, _ = make_node("node-a", 2)
    shared = JobFactory(
        owner=alice, shareable=True, workload="ResNet-50 (batch size 64)",
        gpu_memory_mib=6000, priority_class="best-effort",
    )  # fmt: skip
    wide = JobFactory(owner=alice, shareable=True, gpus=2, workload="LM")
    start_job(JobFactory(owner=alice, shareable=True, workload="A3C"), node)

    state = services.cluster_state()

    by_id = {p.id: p for p in state.pending}
    assert (by_id[shared.pk].workload, by_id[shared.pk].shareable) == (
        "ResNet-50 (batch size 64)",
        True,
    )
    assert by_id[shared.pk].slowdown_cap is None  # best-effort: unbounded
    assert by_id[wide.pk].shareable is False  # multi-GPU jobs never share
    [run] = state.running
    assert (run.workload, run.shareable, run.slowdown_cap) == ("A3C", True, 1.5)
