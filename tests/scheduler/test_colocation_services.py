"""Co-location in production: slots, shared starts and their admission records,
and a whole pass that puts two shareable jobs on one GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from scheduler import services, tasks
from scheduler.models import Allocation, Attempt, Job
from tests.conftest import make_node
from tests.factories import JobFactory, free_gpus, shared_start, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet", "send")]

GIB = 1024


def slots_of(attempt: Attempt) -> list[int]:
    return sorted(attempt.allocations.values_list("slot", flat=True))


@pytest.mark.parametrize(
    ("policy_name", "shareable", "gpus", "slots"),
    [
        ("gpulab", True, 1, [0]),  # a partner may join it
        ("gpulab", False, 1, [0, 1]),
        ("gpulab", True, 2, [0, 0, 1, 1]),  # multi-GPU jobs never share
        ("gpulab-exclusive", True, 1, [0, 1]),
        ("slurm", True, 1, [0, 1]),
    ],
)
def test_a_job_started_alone_takes_one_slot_only_if_it_may_share(
    settings: Any, alice: User, *, policy_name: str, shareable: bool, gpus: int,
    slots: list[int],
) -> None:  # fmt: skip
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "name": policy_name}
    node, _ = make_node("node-a", 2)
    job = JobFactory(owner=alice, shareable=shareable, gpus=gpus)

    assert slots_of(start_job(job, node)) == slots


def test_a_shared_start_takes_the_free_slot_and_keeps_its_admission(
    alice: User, bob: User
) -> None:
    node, _ = make_node("node-a", 1)
    first = JobFactory(owner=alice, shareable=True)
    start_job(first, node)
    gpu = node.gpus.get()
    second = JobFactory(owner=bob, shareable=True)

    result = services.apply_decisions(
        [shared_start(second, gpu.pk, node.pk, (first.pk,))]
    )

    assert result.started == 1
    attempt = Attempt.objects.get(job=second)
    assert slots_of(attempt) == [1]
    assert attempt.admission["partners"] == [first.pk]
    assert attempt.admission["slowdowns"] == {str(second.pk): 1.2, str(first.pk): 1.3}
    assert "shared with job(s)" in second.events.latest("at").message
    # the policy now sees the second job as the one that joined
    joined = {r.id: r.joined_at for r in services.cluster_state().running}
    assert joined[first.pk] is None and joined[second.pk] is not None


def test_a_shared_start_whose_partners_changed_is_skipped(
    alice: User, bob: User
) -> None:
    node, _ = make_node("node-a", 1)
    first = JobFactory(owner=alice, shareable=True)
    start_job(first, node)
    gpu = node.gpus.get()
    late = JobFactory(owner=bob, shareable=True)

    # admitted beside a job that is not the one on the GPU any more
    result = services.apply_decisions([shared_start(late, gpu.pk, node.pk, (999,))])

    assert result.started == 0
    assert Job.objects.get(pk=late.pk).status == Job.Status.PENDING
    assert Allocation.objects.filter(gpu=gpu, released_at__isnull=True).count() == 1


def test_a_shared_start_never_takes_a_slot_of_an_exclusive_job(
    alice: User, bob: User
) -> None:
    node, _ = make_node("node-a", 1)
    first = JobFactory(owner=alice, shareable=False)
    start_job(first, node)
    gpu = node.gpus.get()
    late = JobFactory(owner=bob, shareable=True)

    result = services.apply_decisions(
        [shared_start(late, gpu.pk, node.pk, (first.pk,))]
    )

    assert result.started == 0  # both slots are the first job's


def test_a_pass_puts_two_shareable_jobs_on_one_gpu_and_records_why(
    settings: Any, alice: User, bob: User
) -> None:
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "colo_packing": "pack"}
    node, _ = make_node("node-a", 2, memory_mib=16 * GIB)
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4 * GIB,
                   workload="ResNet-18 (batch size 32)")  # fmt: skip
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=4 * GIB,
                   workload="LM (batch size 20)")  # fmt: skip

    tasks.run_one_pass()

    first, second = (Attempt.objects.get(job=j) for j in (a, b))
    gpus = {x.allocations.get().gpu_id for x in (first, second)}
    assert len(gpus) == 1  # one GPU, two jobs
    assert len(free_gpus(node, 2)) == 1  # the other GPU stays whole
    joined = second if second.admission else first
    assert joined.admission["trial"] is True  # a pair never seen: a trial
    assert joined.admission["rule"] == "trial"


def test_a_job_without_declared_memory_is_not_put_beside_another(
    settings: Any, alice: User, bob: User
) -> None:
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "colo_packing": "pack"}
    make_node("node-a", 1, memory_mib=16 * GIB)
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4 * GIB)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=None)

    tasks.run_one_pass()

    a.refresh_from_db()
    b.refresh_from_db()
    assert a.status == Job.Status.STARTING
    assert b.status == Job.Status.PENDING
    assert "declares no GPU memory" in b.pending_message
