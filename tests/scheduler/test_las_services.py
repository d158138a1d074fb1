"""Preemption by attained service in production: the snapshot gives the policy
each job's attained service and whether it checkpoints, and the pass's LAS
decision goes through the usual preemption path (the kill frame with the job's
checkpoint signal and grace, the requeue, the order after it), on the real
database and the frames agents get through Redis."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
import time_machine

from agents import protocol
from scheduler import policy, services
from scheduler.models import Attempt, Job
from scheduler.services.snapshot import policy_config
from tests.factories import JobFactory
from tests.scheduler.test_checkpointable_services import T0, exit_at, kills, running

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=UTC)


def test_a_checkpointable_job_is_preempted_for_a_new_one_and_resumes_after_it(
    settings: Any,
    alice: User,
    bob: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.GPULAB_LAS_THRESHOLD = 1.0  # GPU-hours: the lower queue from 1 GPU-h
    node_a, node_b = cluster
    # node-b's 2 GPUs: a checkpointable job of alice's that has run 2 h
    victim = JobFactory(
        owner=alice,
        submitted_at=at(0),
        gpus=2,
        checkpointable=True,
        checkpoint_signal="USR1",
        checkpoint_grace_s=90,
    )
    first = running(victim, node_b, at=T0)
    # node-a's 4 GPUs: a job that does not checkpoint
    other = JobFactory(owner=alice, gpus=4)
    running(other, node_a, at=T0)
    new = JobFactory(owner=bob, gpus=2)
    state = services.cluster_state(at(2 * 3600))
    [r] = [r for r in state.running if r.id == victim.pk]
    assert r.checkpointable and r.prior_gpu_s == 0.0
    assert r.attained_gpu_s(state.now) == pytest.approx(2 * 2 * 3600)
    decisions = policy.decide(state)
    [p] = [d for d in decisions if isinstance(d, policy.Preempt)]
    assert (p.victim_id, p.for_job_id) == (victim.pk, new.pk)
    with django_capture_on_commit_callbacks(execute=True):
        services.apply_decisions(decisions)
    [kill] = kills(sent)
    assert (kill.reason, kill.signal, kill.grace_s) == ("preempted", "USR1", 90)
    with django_capture_on_commit_callbacks(execute=True):
        services.finish_attempt(node_b.pk, exit_at(first, T0 + 2 * 3600 + 60))
    victim.refresh_from_db()
    assert victim.status == Job.Status.PENDING
    state = services.cluster_state(at(2 * 3600 + 70))
    [v] = [j for j in state.pending if j.id == victim.pk]
    assert v.checkpointable
    assert v.attained_gpu_s == pytest.approx(2 * (2 * 3600 + 60))
    # older, yet it waits behind the job it was stopped for, which starts
    started = [d.job_id for d in policy.decide(state) if isinstance(d, policy.Start)]
    assert started == [new.pk]


def test_the_wait_bound_setting_orders_an_overdue_job_first_in_production(
    settings: Any, alice: User, bob: User, cluster: list[Node]
) -> None:
    """``GPULAB_MAX_WAIT`` reaches the pass: alice's 4-GPU job with a day's limit
    has waited 3 h, bob's 10-minute one just arrived; only node-a holds 4 GPUs.
    Shortest-first starts bob's, unless alice's is over the bound."""
    old = JobFactory(owner=alice, gpus=4, time_limit_s=86400, submitted_at=at(0))
    new = JobFactory(owner=bob, gpus=4, time_limit_s=600, submitted_at=at(3 * 3600))

    def started() -> set[int]:
        state = services.cluster_state(at(3 * 3600 + 60))
        return {d.job_id for d in policy.decide(state) if isinstance(d, policy.Start)}

    settings.GPULAB_MAX_WAIT = 0.0
    assert started() == {new.pk}
    settings.GPULAB_MAX_WAIT = 2 * 3600.0
    assert services.cluster_state(at(0)).config.max_wait_s == 2 * 3600.0
    assert started() == {old.pk}


def test_the_snapshot_says_when_a_running_attempt_last_checkpointed(
    alice: User, cluster: list[Node]
) -> None:
    _, node_b = cluster
    job = JobFactory(owner=alice, submitted_at=at(0), gpus=2, checkpointable=True)
    attempt = running(job, node_b, at=T0)
    state = services.cluster_state(at(3600))
    [r] = [r for r in state.running if r.id == job.pk]
    assert r.checkpoint_at is None  # none reported yet: a stop loses it all
    with time_machine.travel(at(1800), tick=False):
        services.append_log(
            node_b.pk,
            protocol.JobLogData(
                attempt_id=attempt.pk,
                job_id=job.pk,
                offset=0,
                data="step 10\nGPULAB_CHECKPOINT saved\n",
            ),
        )
    state = services.cluster_state(at(3600))
    [r] = [r for r in state.running if r.id == job.pk]
    assert r.checkpoint_at == pytest.approx(T0 + 1800)


def test_the_snapshot_counts_a_jobs_preemptions_in_the_last_hour(
    alice: User, cluster: list[Node]
) -> None:
    """The hourly bound counts the preemptions of the hour before the pass, not
    every preemption of a job whose last one was recent."""
    _, node_b = cluster
    job = JobFactory(
        owner=alice,
        submitted_at=at(0),
        checkpointable=True,
        attempts=4,
        preemptions=3,
        last_preempted_at=at(5.5 * 3600),
    )
    # preempted at 1 h, 5.2 h and 5.5 h; sent back at 5 h by an eviction (a
    # co-location partner suffered), which is no preemption
    for number, ended, why in (
        (1, 1.0, "preempted"), (2, 5.0, "evicted"), (3, 5.2, "preempted"),
        (4, 5.5, "preempted"),
    ):  # fmt: skip
        Attempt.objects.create(
            job=job, number=number, node=node_b, started_at=at(ended * 3600 - 600),
            ended_at=at(ended * 3600), kill_reason=why,
        )  # fmt: skip

    def waiting(hours: float) -> int:
        state = services.cluster_state(at(hours * 3600))
        [j] = [j for j in state.pending if j.id == job.pk]
        return j.preemptions_last_hour

    assert [waiting(h) for h in (5.6, 6.3, 6.6)] == [2, 1, 0]
    running(job, node_b, at=T0 + 6 * 3600)
    state = services.cluster_state(at(6.1 * 3600))
    [r] = [r for r in state.running if r.id == job.pk]
    assert r.preemptions_last_hour == 2
    # and when it was last preempted: the bound after a preemption reads it
    assert r.preempted_at == pytest.approx(T0 + 5.5 * 3600)


def test_the_victim_rules_reach_the_policy_from_the_settings(settings: Any) -> None:
    assert policy_config().las_victims == "attained"
    assert policy_config().las_shorter is False
    settings.GPULAB_LAS_VICTIMS = "remaining"
    settings.GPULAB_LAS_SHORTER = True
    config = policy_config()
    assert (config.las_victims, config.las_shorter) == ("remaining", True)


def test_the_bound_after_a_preemption_reaches_the_policy_from_the_settings(
    settings: Any,
) -> None:
    assert policy_config().preempted_max_wait_s == 0.0
    settings.GPULAB_PREEMPTED_MAX_WAIT = 12 * 3600.0
    assert policy_config().preempted_max_wait_s == 12 * 3600.0
