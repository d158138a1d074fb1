"""Co-location in production: slots, shared starts and their admission records,
and a whole pass that puts two shareable jobs on one GPU."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.admin.models import LogEntry
from django.utils import timezone

from agents import protocol
from scheduler import pass_runner, policy, services
from scheduler.models import Allocation, Attempt, InterferencePair, Job
from tests.conftest import make_node
from tests.factories import (
    JobFactory,
    exited_data,
    free_gpus,
    shared_start,
    start_job,
    started_data,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db

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


def one_job_on_one_gpu(
    alice: User, bob: User, *, shareable: bool = True
) -> tuple[Node, Job, Any, Job]:
    """node-a's one GPU runs alice's job; bob's shareable job waits."""
    node, _ = make_node("node-a", 1)
    first = JobFactory(owner=alice, shareable=shareable)
    start_job(first, node)
    return node, first, node.gpus.get(), JobFactory(owner=bob, shareable=True)


def test_a_shared_start_takes_the_free_slot_and_keeps_its_admission(
    alice: User, bob: User
) -> None:
    node, first, gpu, second = one_job_on_one_gpu(alice, bob)

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
    node, _first, gpu, late = one_job_on_one_gpu(alice, bob)

    # admitted beside a job that is not the one on the GPU any more
    result = services.apply_decisions([shared_start(late, gpu.pk, node.pk, (999,))])

    assert result.started == 0
    assert Job.objects.get(pk=late.pk).status == Job.Status.PENDING
    assert Allocation.objects.filter(gpu=gpu, released_at__isnull=True).count() == 1


def test_a_shared_start_never_takes_a_slot_of_an_exclusive_job(
    alice: User, bob: User
) -> None:
    node, first, gpu, late = one_job_on_one_gpu(alice, bob, shareable=False)

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

    pass_runner.run_one_pass()

    first, second = (Attempt.objects.get(job=j) for j in (a, b))
    gpus = {x.allocations.get().gpu_id for x in (first, second)}
    assert len(gpus) == 1  # one GPU, two jobs
    assert len(free_gpus(node, 2)) == 1  # the other GPU stays whole
    joined = second if second.admission else first
    assert joined.admission["trial"] is True  # a pair never seen: a trial
    assert joined.admission["rule"] == "trial"


def test_a_pair_seen_once_a_hair_over_its_cap_is_re_tried_and_counted_as_a_trial(
    settings: Any, alice: User, bob: User
) -> None:
    # one episode of LM beside ResNet-18 read 1.50x (its cap is 1.5x); pairs seen
    # again and again elsewhere give the episode noise its degrees of freedom
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "colo_packing": "pack"}
    lm, rn = "LM (batch size 20)", "ResNet-18 (batch size 32)"
    InterferencePair.objects.create(
        workload_a=lm, workload_b=rn, n=1, mean_log=math.log(1.5), m2=0.0
    )
    InterferencePair.objects.create(
        workload_a=rn, workload_b=lm, n=1, mean_log=math.log(1.1), m2=0.0
    )
    InterferencePair.objects.create(
        workload_a="c", workload_b="d", n=11, mean_log=math.log(1.2), m2=0.0044
    )
    make_node("node-a", 1, memory_mib=16 * GIB)
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4 * GIB, workload=rn)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=4 * GIB, workload=lm)

    pass_runner.run_one_pass()

    joined = Attempt.objects.get(job=b)
    assert Attempt.objects.get(job=a).admission is None  # it started alone
    assert (joined.admission["rule"], joined.admission["trial"]) == ("trial", True)
    assert joined.admission["message"].startswith(
        "re-trial: the pair was seen in 1 episode,"
    )
    # the next pass counts it against the pair's hourly trial budget
    assert services.cluster_state().trials_last_hour == {frozenset((lm, rn)): 1}


def test_a_job_without_declared_memory_is_not_put_beside_another(
    settings: Any, alice: User, bob: User
) -> None:
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "colo_packing": "pack"}
    make_node("node-a", 1, memory_mib=16 * GIB)
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4 * GIB)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=None)

    pass_runner.run_one_pass()

    a.refresh_from_db()
    b.refresh_from_db()
    assert a.status == Job.Status.STARTING
    assert b.status == Job.Status.PENDING
    assert "declares no GPU memory" in b.pending_message


# ------------------------------------------------------------------ learning


def shared_pair(alice: User, bob: User, **second: Any) -> tuple[Job, Job, Node]:
    node, _ = make_node("node-a", 1)
    first = JobFactory(owner=alice, shareable=True, workload="rn18")
    start_job(first, node)
    later = JobFactory(owner=bob, shareable=True, workload="lm", **second)
    gpu = node.gpus.get()
    assert services.apply_decisions(
        [shared_start(later, gpu.pk, node.pk, (first.pk,))]
    ).started
    return first, later, node


def test_an_eviction_stops_the_later_job_requeues_it_and_bans_the_pair(
    alice: User, bob: User, sent: AgentFrames, django_capture_on_commit_callbacks: Any
) -> None:
    first, later, node = shared_pair(alice, bob)
    attempt = Attempt.objects.get(job=later)
    services.mark_started(node.pk, started_data(attempt))
    evict = policy.Evict(later.pk, first.pk, "job 1 ran 1.9x slower", ("lm", "rn18"))

    with django_capture_on_commit_callbacks(execute=True):
        result = services.apply_decisions([evict])

    assert result.evicted == 1
    frame = sent.calls()[-1][1]
    assert (frame["type"], frame["data"]["reason"]) == ("job.kill", "evicted")
    knowledge, _ = services.load_knowledge(timezone.now())
    assert frozenset(("lm", "rn18")) in knowledge.harmful
    assert services.apply_decisions([evict]).evicted == 0  # already being stopped

    services.finish_attempt(node.pk, exited_data(attempt, 143, reason="killed"))

    later.refresh_from_db()
    assert later.status == Job.Status.PENDING
    assert later.events.filter(
        message__contains="sent back to the queue (its age is kept)"
    ).exists()


def test_an_eviction_too_close_to_a_cap_requeues_without_banning_the_pair(
    alice: User, bob: User
) -> None:
    # measured within the cap but not by the admission's margin: the job goes,
    # the pair is judged again by what its episode measured
    first, later, node = shared_pair(alice, bob)
    services.mark_started(node.pk, started_data(Attempt.objects.get(job=later)))
    evict = policy.Evict(
        later.pk, first.pk, "too close to its cap", ("lm", "rn18"), harmful=False
    )

    assert services.apply_decisions([evict]).evicted == 1
    knowledge, _ = services.load_knowledge(timezone.now())
    assert not knowledge.harmful


def test_a_job_that_may_not_be_requeued_is_not_evicted(alice: User, bob: User) -> None:
    first, later, _node = shared_pair(alice, bob, evictable=False)

    result = services.apply_decisions(
        [policy.Evict(later.pk, first.pk, "over", ("lm", "rn18"))]
    )

    assert result.evicted == 0
    assert not InterferencePair.objects.exists()


def test_the_snapshot_loads_what_was_learned_and_the_hours_trials(
    alice: User, bob: User
) -> None:
    InterferencePair.objects.create(
        workload_a="lm", workload_b="rn18", n=3, mean_log=0.2, m2=0.01
    )
    services.mark_harmful("a3c", "lm", reason="evicted once")
    first, later, _node = shared_pair(alice, bob)
    Attempt.objects.filter(job=later).update(
        admission={"trial": True, "workloads": ["lm", "rn18"], "partners": [first.pk]}
    )

    state = services.cluster_state()

    assert state.knowledge.pairs["lm", "rn18"] == policy.Observations(3, 0.2, 0.01)
    assert state.knowledge.harmful == {frozenset(("a3c", "lm"))}
    assert state.trials_last_hour == {frozenset(("lm", "rn18")): 1}


def test_an_admin_resets_a_pair_and_it_is_in_the_history(
    client: Client, django_user_model: Any
) -> None:
    client.force_login(
        django_user_model.objects.create_superuser("ops", "ops@lab.example", "pw-ops")
    )
    services.mark_harmful("a3c", "lm", reason="evicted once")
    pair = InterferencePair.objects.get(workload_a="a3c")

    response = client.post(
        "/admin/scheduler/interferencepair/",
        {"action": "reset", "_selected_action": [pair.pk]},
    )

    assert response.status_code == 302
    pair.refresh_from_db()
    assert (pair.harmful, pair.n, pair.reset_by is not None) == (False, 0, True)
    entry = LogEntry.objects.get(object_id=str(pair.pk))
    assert "reset (was n=0" in entry.change_message
    knowledge, _ = services.load_knowledge(timezone.now())
    assert frozenset(("a3c", "lm")) in knowledge.harmful  # the other order is kept


# ------------------------------------------------------------------ memory


def sample(gpu: Any, procs: list[tuple[int, int]]) -> protocol.MetricsData:
    return protocol.MetricsData(
        sampled_at=time.time(),
        gpus=[
            protocol.GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                processes=[
                    protocol.ProcessSample(pid=100 + i, used_memory_mib=mib,
                                           attempt_id=aid)
                    for i, (aid, mib) in enumerate(procs)
                ],
            )
        ],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("first_uses", "later_uses", "stopped"),
    [
        (4000, 8000, None),  # both within what they declared (+512 MiB headroom)
        (4000, 8800, "later"),  # the later job overran: it is the one stopped
        (4700, 8000, "first"),  # the first did: it is stopped, not its partner
    ],
)
def test_on_a_shared_gpu_the_job_over_its_declared_memory_is_stopped(
    alice: User, bob: User, sent: AgentFrames, django_capture_on_commit_callbacks: Any,
    first_uses: int, later_uses: int, stopped: str | None,
) -> None:  # fmt: skip
    first, later, node = shared_pair(alice, bob)
    Job.objects.filter(pk=first.pk).update(gpu_memory_mib=4096)
    Job.objects.filter(pk=later.pk).update(gpu_memory_mib=8192)
    a, b = (Attempt.objects.get(job=j) for j in (first, later))
    gpu = node.gpus.get()

    with django_capture_on_commit_callbacks(execute=True):
        services.record_metrics(node.pk, sample(gpu, [(a.pk, first_uses),
                                                      (b.pk, later_uses)]))  # fmt: skip

    kills = {
        f["data"]["job_id"]: f["data"]["reason"] for _, f in sent.of_type("job.kill")
    }
    expected = {"first": first.pk, "later": later.pk}.get(stopped or "")
    assert kills == ({expected: "memory_overrun"} if expected else {})


def test_a_job_alone_on_its_gpu_may_use_more_than_it_declared(
    alice: User, sent: AgentFrames
) -> None:
    node, _ = make_node("node-a", 1)
    job = JobFactory(owner=alice, shareable=True, gpu_memory_mib=1024)
    attempt = start_job(job, node)

    services.record_metrics(
        node.pk, sample(node.gpus.get(), [(attempt.pk, 9000), (attempt.pk, 9000)])
    )

    assert not Attempt.objects.get(pk=attempt.pk).kill_reason


def test_a_job_stopped_for_its_memory_fails_with_that_reason(
    alice: User, bob: User, sent: AgentFrames
) -> None:
    first, later, node = shared_pair(alice, bob)
    Job.objects.filter(pk=later.pk).update(gpu_memory_mib=1024)
    a, b = (Attempt.objects.get(job=j) for j in (first, later))
    services.mark_started(node.pk, started_data(b))
    services.record_metrics(node.pk, sample(node.gpus.get(), [(a.pk, 100),
                                                              (b.pk, 9000)]))  # fmt: skip

    services.finish_attempt(node.pk, exited_data(b, 137, reason="killed"))

    later.refresh_from_db()
    assert later.status == Job.Status.FAILED
    assert "more GPU memory than it declared on a shared GPU" in later.end_reason
    assert Attempt.objects.get(pk=a.pk).ended_at is None  # its partner runs on
