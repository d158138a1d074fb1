"""What the agents' samples teach co-location: a job's peak GPU memory (the memory
rule reads it beside the declaration), a workload's solo busy fraction (the
interference model's prior) and, for a job that reports no progress, its slowdown
read from per-process utilisation (weak evidence)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.utils import timezone

from agents import protocol
from scheduler import metrics, pass_runner, policy, services
from scheduler.models import Attempt, InterferencePair, Job
from scheduler.policy.interference import WEAK_WEIGHT, Model, Profile
from scheduler.services import interference
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, shared_start, start_job

if TYPE_CHECKING:
    from datetime import datetime

    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

MIN = timedelta(minutes=1)
GIB = 1024


def frame(
    gpu: Any, at: datetime, procs: list[tuple[int, int | None, float | None]]
) -> protocol.MetricsData:
    """One GPU's sample: ``(attempt id, used MiB, SM %)`` per process."""
    return protocol.MetricsData(
        sampled_at=at.timestamp(),
        gpus=[
            protocol.GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                processes=[
                    protocol.ProcessSample(
                        pid=100 + i, used_memory_mib=mib, sm_util=sm, attempt_id=aid
                    )
                    for i, (aid, mib, sm) in enumerate(procs)
                ],
            )
        ],
    )


def persist(
    gpu: Any, at: datetime, procs: list[tuple[int, int | None, float | None]]
) -> None:
    metrics.store_samples({gpu.index: gpu.pk}, frame(gpu, at, procs))


# -- peak memory --------------------------------------------------------------


def test_a_persisted_frame_raises_the_peak_and_never_lowers_it(alice: User) -> None:
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    attempt = start_job(JobFactory(owner=alice, gpu_memory_mib=4096), node)
    now = timezone.now()

    # two processes of one job on one GPU add up
    services.record_metrics(
        node.pk, frame(gpu, now, [(attempt.pk, 3000, 50.0), (attempt.pk, 2000, 9.0)]),
        persist=True,
    )  # fmt: skip
    services.record_metrics(
        node.pk, frame(gpu, now + MIN, [(attempt.pk, 1000, 50.0)]), persist=True
    )

    assert Attempt.objects.get(pk=attempt.pk).peak_memory_mib == 5000


def test_a_live_only_frame_leaves_the_peak(alice: User) -> None:
    node, _ = make_node("node-a", 1)
    attempt = start_job(JobFactory(owner=alice), node)

    services.record_metrics(
        node.pk, frame(node.gpus.get(), timezone.now(), [(attempt.pk, 3000, 50.0)])
    )

    assert Attempt.objects.get(pk=attempt.pk).peak_memory_mib is None


def test_the_snapshot_gives_the_policy_each_running_jobs_peak(alice: User) -> None:
    node, _ = make_node("node-a", 1)
    job = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4096)
    attempt = start_job(job, node)
    Attempt.objects.filter(pk=attempt.pk).update(peak_memory_mib=30_000)

    running = {r.id: r for r in services.cluster_state().running}

    assert running[job.pk].gpu_memory_mib == 4096
    assert running[job.pk].peak_memory_mib == 30_000


@pytest.mark.parametrize(("peak", "outcome"), [(None, "shares"), (14 * GIB, "waits")])
def test_a_job_that_peaked_over_its_declaration_keeps_newcomers_off_its_gpu(
    settings: Any, alice: User, bob: User, peak: int | None, outcome: str
) -> None:
    """The resident declared 4 GiB of the 16 GiB GPU: a 4 GiB newcomer fits
    beside it, unless it was seen holding 14 GiB."""
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "colo_packing": "pack"}
    node, _ = make_node("node-a", 1, memory_mib=16 * GIB)
    first = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4 * GIB)
    attempt = start_job(first, node)
    Attempt.objects.filter(pk=attempt.pk).update(peak_memory_mib=peak)
    later = JobFactory(owner=bob, shareable=True, gpu_memory_mib=4 * GIB)

    pass_runner.run_one_pass()

    later.refresh_from_db()
    if outcome == "shares":
        assert later.status == Job.Status.STARTING
    else:
        assert later.status == Job.Status.PENDING
        assert "memory" in later.pending_message


# -- solo busy fraction -------------------------------------------------------


def test_an_attempt_keeps_its_solo_busy_fraction_when_it_ends(alice: User) -> None:
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    attempt = start_job(JobFactory(owner=alice, workload="rn18"), node)
    t0 = timezone.now() - 10 * MIN
    Attempt.objects.filter(pk=attempt.pk).update(started_at=t0, created_at=t0)
    for m, sm in enumerate([60.0, 70.0, None, 80.0]):
        persist(gpu, t0 + m * MIN, [(attempt.pk, 1000, sm)])
    # another job's process on the same GPU is not its activity
    persist(gpu, t0 + 5 * MIN, [(attempt.pk, 1000, 70.0), (attempt.pk + 1, 1, 99.0)])
    attempt.refresh_from_db()

    services.finish_attempt(node.pk, exited_data(attempt, 0))

    assert Attempt.objects.get(pk=attempt.pk).solo_busy == pytest.approx(0.70)
    assert interference.solo_busies(["rn18", "other"]) == {"rn18": pytest.approx(0.70)}


def test_too_few_samples_give_no_busy_fraction(alice: User) -> None:
    node, _ = make_node("node-a", 1)
    attempt = start_job(JobFactory(owner=alice, workload="rn18"), node)
    t0 = timezone.now() - 10 * MIN
    Attempt.objects.filter(pk=attempt.pk).update(started_at=t0, created_at=t0)
    persist(node.gpus.get(), t0, [(attempt.pk, 1000, 60.0)])
    attempt.refresh_from_db()

    services.finish_attempt(node.pk, exited_data(attempt, 0))

    assert Attempt.objects.get(pk=attempt.pk).solo_busy is None


def test_a_workloads_busy_fraction_is_the_median_of_its_recent_runs(
    alice: User,
) -> None:
    node, _ = make_node("node-old", 0)
    for i, busy in enumerate([0.2, 0.9, 0.5]):
        Attempt.objects.create(
            job=JobFactory(owner=alice, workload="lm", status=Job.Status.COMPLETED),
            number=1, node=node, solo_busy=busy,
            ended_at=timezone.now() - timedelta(hours=i + 1),
        )  # fmt: skip

    assert interference.solo_busies(["lm"]) == {"lm": pytest.approx(0.5)}
    knowledge, _ = services.load_knowledge(timezone.now(), ["lm"])
    assert knowledge.busy == {"lm": pytest.approx(0.5)}


def test_the_prior_reads_the_measured_busy_fractions() -> None:
    """A workload measured to keep the GPU busy a tenth of its time barely slows
    a partner, where the default assumption (0.8) predicts a lot."""
    measured = Model(policy.Knowledge(busy={"io-bound": 0.1}))
    default = Model(policy.Knowledge())
    a, b = Profile("resnet", 8192), Profile("io-bound", 8192)

    assert measured.estimate(a, b).slowdown == pytest.approx(1 + 0.8 * 0.1)
    assert default.estimate(a, b).slowdown == pytest.approx(1 + 0.8 * 0.8)


# -- weak evidence from utilisation ------------------------------------------


def old_busy(workload: str, busy: float, alice: User) -> None:
    Attempt.objects.create(
        job=JobFactory(owner=alice, workload=workload, status=Job.Status.COMPLETED),
        number=1, node=make_node(f"old-{workload}", 0)[0], solo_busy=busy,
        ended_at=timezone.now() - timedelta(days=1),
    )  # fmt: skip


def test_an_episode_without_progress_is_read_from_utilisation(
    alice: User, bob: User
) -> None:
    """Neither job reports progress: each one's solo busy fraction over its busy
    fraction while they shared is its slowdown, kept as weak evidence."""
    old_busy("rn18", 0.8, alice)
    old_busy("lm", 0.6, alice)
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    first = JobFactory(owner=alice, shareable=True, workload="rn18")
    start_job(first, node)
    later = JobFactory(owner=bob, shareable=True, workload="lm")
    services.apply_decisions([shared_start(later, gpu.pk, node.pk, (first.pk,))])
    a, b = (Attempt.objects.get(job=j) for j in (first, later))
    t0 = timezone.now() - 10 * MIN
    Attempt.objects.filter(pk__in=[a.pk, b.pk]).update(
        created_at=t0, shared_at=t0, started_at=t0
    )
    for m in range(6):
        persist(gpu, t0 + m * MIN, [(a.pk, 1000, 40.0), (b.pk, 1000, 50.0)])
    a.refresh_from_db()

    services.finish_attempt(node.pk, exited_data(a, 0, at=(t0 + 10 * MIN).timestamp()))

    rows = {(p.workload_a, p.workload_b): p for p in InterferencePair.objects.all()}
    assert rows["rn18", "lm"].n == 0  # nothing measured from progress
    assert rows["rn18", "lm"].util_n == 1
    assert math.exp(rows["rn18", "lm"].util_mean_log) == pytest.approx(2.0)
    assert math.exp(rows["lm", "rn18"].util_mean_log) == pytest.approx(1.2)
    knowledge, _ = services.load_knowledge(timezone.now())
    assert knowledge.weak["rn18", "lm"].mean == pytest.approx(math.log(2.0))
    assert not knowledge.pairs


def test_weak_evidence_moves_the_estimate_and_counts_a_quarter() -> None:
    weak = policy.Observations.of([math.log(2.0)] * 2)
    model = Model(policy.Knowledge(weak={("a", "b"): weak}))

    got = model.estimate(Profile("a"), Profile("b"))

    evidence = 2 * WEAK_WEIGHT
    assert got.source == "utilisation"
    assert got.confidence == pytest.approx(evidence / (evidence + 1))
    assert got.observations == 0
    assert 1.64 < got.slowdown < 2.0  # pulled from the prior (1.64) towards 2


def test_weak_evidence_never_counts_more_than_one_observation() -> None:
    weak = policy.Observations.of([math.log(3.0)] * 40)
    exact = policy.Observations.of([math.log(1.1)])
    model = Model(policy.Knowledge(weak={("a", "b"): weak}))
    both = Model(policy.Knowledge(pairs={("a", "b"): exact}, weak={("a", "b"): weak}))

    assert model.estimate(Profile("a"), Profile("b")).confidence == pytest.approx(0.5)
    got = both.estimate(Profile("a"), Profile("b"))
    assert got.source == "pair"
    assert got.confidence == pytest.approx(2 / 3)


def test_a_reset_forgets_the_weak_evidence_too(alice: User) -> None:
    row = InterferencePair.objects.create(
        workload_a="a", workload_b="b", util_n=3, util_mean_log=0.5, util_m2=0.1
    )

    services.reset_interference_pairs([row.pk], alice.pk)

    row.refresh_from_db()
    assert (row.util_n, row.util_mean_log, row.util_m2) == (0, 0.0, 0.0)
