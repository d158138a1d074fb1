"""The job lifecycle verbs of scheduler.services: start, started, exit, cancel,
hello reconcile, lost nodes and logs."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from django.conf import settings
from django.utils import timezone

from agents import protocol
from scheduler import policy, services
from scheduler.models import (
    Allocation,
    Attempt,
    Job,
    JobEvent,
    JobLogChunk,
    Node,
    UsageRecord,
)
from tests.conftest import hello_data
from tests.factories import (
    JobFactory,
    exited_data,
    free_gpus,
    parse_command,
    start_job,
    started_data,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db

T0 = 1_800_000_000.0  # an agent clock far from the test's wall clock


def running(job: Job, node: Node) -> Attempt:
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    return attempt


# ------------------------------------------------------------------ apply_decisions


def test_it_starts_a_job_with_one_allocation_per_gpu_slot(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, gpus=2)
    gpus = free_gpus(node, 2)

    with django_capture_on_commit_callbacks(execute=True):
        result = services.apply_decisions(
            [policy.Start.on(job.pk, node.pk, tuple(g.pk for g in gpus))]
        )
        assert sent.count() == 0

    job.refresh_from_db()
    assert (result.started, result.skipped) == (1, 0)
    assert job.status == Job.Status.STARTING
    assert job.attempts == 1
    attempt = Attempt.objects.get(job=job)
    assert attempt.node == node and attempt.number == 1 and attempt.is_live
    held = sorted(attempt.allocations.values_list("gpu_id", "slot"))
    assert held == sorted((g.pk, s) for g in gpus for s in range(g.slots))
    assert all(g.slots == settings.GPULAB_GPU_JOB_LIMIT for g in gpus)
    assert JobEvent.objects.filter(
        job=job, from_status="pending", to_status="starting"
    ).exists()


def test_it_sends_one_launch_to_the_node_after_commit(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, gpus=2, env={"SEED": "1"})
    gpus = free_gpus(node, 2)

    with django_capture_on_commit_callbacks(execute=True):
        services.apply_decisions(
            [policy.Start.on(job.pk, node.pk, tuple(g.pk for g in gpus))]
        )

    attempt = Attempt.objects.get(job=job)
    node_id, command = sent.only()
    assert node_id == node.pk
    launch = parse_command(command)
    assert isinstance(launch, protocol.JobLaunch)
    assert launch.data.attempt_id == attempt.pk
    assert launch.data.attempt == 1
    assert launch.data.job_id == job.pk
    assert launch.data.gpu_uuids == [g.uuid for g in gpus]
    assert launch.data.command == job.command
    assert launch.data.env == {"SEED": "1", "GPULAB_RESTART_COUNT": "0"}
    assert launch.data.time_limit_s == job.time_limit_s


def test_it_skips_a_start_for_a_job_no_longer_pending(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    services.cancel_job(job.pk, by=alice)

    result = services.apply_decisions(
        [policy.Start.on(job.pk, node.pk, (free_gpus(node, 1)[0].pk,))]
    )

    job.refresh_from_db()
    assert (result.started, result.skipped) == (0, 1)
    assert job.status == Job.Status.CANCELLED
    assert not Attempt.objects.filter(job=job).exists()


def test_it_skips_a_start_whose_gpu_is_taken(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    gpu = free_gpus(node, 1)[0]
    first = JobFactory(owner=alice)
    second = JobFactory(owner=alice)
    start_job(first, node, [gpu])

    result = services.apply_decisions([policy.Start.on(second.pk, node.pk, (gpu.pk,))])

    second.refresh_from_db()
    assert (result.started, result.skipped) == (0, 1)
    assert second.status == Job.Status.PENDING
    assert second.attempts == 0
    assert Allocation.objects.filter(gpu=gpu, released_at__isnull=True).count() == (
        gpu.slots
    )
    assert not Attempt.objects.filter(job=second).exists()


def test_it_records_the_reason_a_job_waits(alice: User, cluster: list[Node]) -> None:
    job = JobFactory(owner=alice)
    wait = policy.Wait(job.pk, policy.Reason.RESOURCES, "all 6 GPUs are busy")

    first = services.apply_decisions([wait])
    again = services.apply_decisions([wait])

    job.refresh_from_db()
    assert (job.pending_reason, job.pending_message) == (
        "resources",
        "all 6 GPUs are busy",
    )
    assert (first.updated_reasons, again.updated_reasons) == (1, 0)


# ------------------------------------------------------------------ mark_started


def test_it_marks_a_starting_job_running(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)

    changed = services.mark_started(node.pk, started_data(attempt, T0))

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert changed is True
    assert job.status == Job.Status.RUNNING
    assert job.started_at.timestamp() == T0
    assert attempt.started_at.timestamp() == T0
    assert attempt.pid == 4242


def test_it_ignores_a_replayed_started(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    events_before = JobEvent.objects.filter(job=job).count()

    changed = services.mark_started(node.pk, started_data(attempt, T0 + 50))

    job.refresh_from_db()
    assert changed is False
    assert job.status == Job.Status.RUNNING
    assert job.started_at.timestamp() == T0
    assert JobEvent.objects.filter(job=job).count() == events_before


def test_it_rejects_a_started_from_another_node(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node_a, node_b = cluster
    job = JobFactory(owner=alice)
    attempt = start_job(job, node_a)

    changed = services.mark_started(node_b.pk, started_data(attempt, T0))

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert changed is False
    assert job.status == Job.Status.STARTING
    assert attempt.started_at is None


# ------------------------------------------------------------------ finish_attempt


def test_it_ends_a_job_stopped_at_its_time_limit_as_timeout(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, time_limit_s=5400)
    attempt = running(job, node)

    services.finish_attempt(
        node.pk, exited_data(attempt, 143, at=T0 + 60, reason="timeout")
    )

    job.refresh_from_db()
    assert job.status == Job.Status.TIMEOUT
    assert job.exit_code == 143
    assert job.end_reason == "stopped at its time limit (1:30:00)"


def test_it_requeues_a_job_the_agent_stopped_on_its_own(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    """An agent cut off from the portal may stop its jobs: a node problem, so the
    job goes back to the queue instead of failing."""
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    data = exited_data(attempt, 143, at=T0 + 60, reason="killed")
    data = data.model_copy(update={"message": "agent cut off from the portal"})

    services.finish_attempt(node.pk, data)

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert job.end_reason == ""
    assert "agent cut off from the portal" in job.events.last().message


@pytest.mark.parametrize(
    ("exit_code", "reason", "status", "says"),
    [
        (0, "exited", Job.Status.COMPLETED, "completed (exit code 0)"),
        (3, "exited", Job.Status.FAILED, "failed with exit code 3"),
        # The program was killed by something else than gpulab (e.g. the OOM
        # killer): the user's failure.
        (137, "exited", Job.Status.FAILED, "failed with exit code 137"),
    ],
)
def test_it_ends_a_job_by_its_exit(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    exit_code: int,
    reason: str,
    status: str,
    says: str,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)

    changed = services.finish_attempt(
        node.pk, exited_data(attempt, exit_code, at=T0 + 60, reason=reason)
    )

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert changed is True
    assert job.status == status
    assert job.exit_code == exit_code
    assert job.end_reason == says
    assert job.finished_at.timestamp() == T0 + 60
    assert attempt.ended_at.timestamp() == T0 + 60
    assert attempt.outcome == reason
    assert JobEvent.objects.filter(job=job, to_status=status).count() == 1


def test_it_fails_a_job_that_could_not_be_launched(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)

    services.finish_attempt(
        node.pk,
        exited_data(
            attempt,
            None,
            reason="launch_failed",
            message="workdir /nope does not exist",
        ),
    )

    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert "workdir /nope does not exist" in job.end_reason
    assert not Allocation.objects.filter(attempt=attempt, released_at=None).exists()
    assert not UsageRecord.objects.exists()  # it never ran: nothing to charge


def test_it_requeues_a_job_whose_process_was_lost(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)

    services.finish_attempt(node.pk, exited_data(attempt, None, reason="lost"))

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert job.finished_at is None
    assert not Attempt.objects.filter(job=job, ended_at__isnull=True).exists()


def test_it_ignores_a_duplicate_exit(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    services.finish_attempt(node.pk, exited_data(attempt, 0, at=T0 + 10))

    again = services.finish_attempt(node.pk, exited_data(attempt, 1, at=T0 + 99))

    job.refresh_from_db()
    assert again is False
    assert job.status == Job.Status.COMPLETED
    assert job.exit_code == 0
    assert UsageRecord.objects.filter(attempt=attempt).count() == 1
    assert JobEvent.objects.filter(job=job, to_status="completed").count() == 1
    assert JobEvent.objects.filter(job=job, to_status="failed").count() == 0


def test_it_ignores_an_exit_reported_by_another_node(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node_a, node_b = cluster
    job = JobFactory(owner=alice)
    attempt = running(job, node_a)

    changed = services.finish_attempt(node_b.pk, exited_data(attempt, 0))

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert changed is False
    assert job.status == Job.Status.RUNNING
    assert attempt.is_live


def test_it_cancels_a_job_whose_cancel_was_requested(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    services.cancel_job(job.pk, by=alice)

    services.finish_attempt(node.pk, exited_data(attempt, 143, reason="killed"))

    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED
    assert job.exit_code == 143


def test_it_releases_allocations_and_charges_agent_reported_time(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, gpus=2)
    attempt = running(job, node)

    services.finish_attempt(node.pk, exited_data(attempt, 0, at=T0 + 250.5))

    ended = attempt.allocations.values_list("released_at", flat=True)
    assert {r.timestamp() for r in ended} == {T0 + 250.5}
    records = list(UsageRecord.objects.filter(attempt=attempt).order_by("gpu_id"))
    assert [r.gpu_id for r in records] == sorted(
        attempt.allocations.values_list("gpu_id", flat=True).distinct()
    )
    for record in records:
        assert record.share == 1.0  # an exclusive job holds every slot
        assert record.gpu_seconds == pytest.approx(250.5)
        assert (record.user, record.group) == (alice, job.group)
    assert free_gpus(node, 4) == list(node.gpus.order_by("index"))


def test_a_job_alone_on_its_gpu_pays_all_of_it_whatever_slots_it_held(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    attempt = running(JobFactory(owner=alice), node)
    # a shareable job started alone holds one of the GPU's two slots
    attempt.allocations.filter(slot=1).delete()

    services.finish_attempt(node.pk, exited_data(attempt, 0, at=T0 + 100))

    record = UsageRecord.objects.get(attempt=attempt)
    assert (record.share, record.gpu_seconds) == (1.0, pytest.approx(100.0))


def test_two_jobs_sharing_a_gpu_pay_half_of_it_while_they_share(
    alice: User, bob: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    first = running(JobFactory(owner=alice), node)
    gpu = first.allocations.get(slot=0).gpu
    first.allocations.filter(slot=1).delete()
    # the second joins 50 s (on the allocations' clock) into the first's 100 s
    t0 = first.allocations.get().allocated_at
    second = Attempt.objects.create(
        job=JobFactory(owner=bob, status=Job.Status.RUNNING), number=1, node=node,
        started_at=t0 + timedelta(seconds=50), created_at=t0 + timedelta(seconds=50),
    )  # fmt: skip
    Allocation.objects.create(
        attempt=second, gpu=gpu, slot=1, allocated_at=t0 + timedelta(seconds=50)
    )
    Attempt.objects.filter(pk=first.pk).update(started_at=t0)
    first.refresh_from_db()

    services.finish_attempt(
        node.pk, exited_data(first, 0, at=(t0 + timedelta(seconds=100)).timestamp())
    )

    record = UsageRecord.objects.get(attempt=first)
    assert record.share == pytest.approx(0.75)  # 50 s alone + 50 s at half
    assert record.gpu_seconds == pytest.approx(75.0)


def test_it_never_charges_negative_time_for_a_skewed_clock(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)

    services.finish_attempt(node.pk, exited_data(attempt, 0, at=T0 - 30))

    assert UsageRecord.objects.get(attempt=attempt).gpu_seconds == 0


# ------------------------------------------------------------------ cancel_job


def test_it_cancels_a_pending_job_at_once(alice: User, cluster: list[Node]) -> None:
    job = JobFactory(owner=alice)

    services.cancel_job(job.pk, by=alice)

    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED
    assert job.finished_at is not None
    assert job.end_reason == "cancelled by alice"
    assert JobEvent.objects.get(job=job).actor == alice


def test_it_asks_the_node_to_kill_a_running_job_after_commit(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, kill_grace_s=12)
    attempt = running(job, node)
    sent.clear()

    with django_capture_on_commit_callbacks(execute=True):
        services.cancel_job(job.pk, by=alice)
        assert sent.count() == 0

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    assert job.cancel_requested_at is not None
    assert attempt.kill_reason == "cancelled"
    node_id, command = sent.only()
    kill = parse_command(command)
    assert node_id == node.pk
    assert isinstance(kill, protocol.JobKill)
    assert (kill.data.attempt_id, kill.data.job_id) == (attempt.pk, job.pk)
    assert (kill.data.reason, kill.data.grace_s) == ("cancelled", 12)


@pytest.mark.parametrize(
    "status", [Job.Status.COMPLETED, Job.Status.FAILED, Job.Status.CANCELLED]
)
def test_it_refuses_to_cancel_an_ended_job(
    alice: User, cluster: list[Node], status: str
) -> None:
    job = JobFactory(owner=alice, status=status)

    with pytest.raises(services.JobStateError, match="already ended"):
        services.cancel_job(job.pk, by=alice)

    job.refresh_from_db()
    assert job.status == status
    assert job.cancel_requested_at is None


def test_it_refuses_a_second_cancel(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    running(job, cluster[0])
    services.cancel_job(job.pk, by=alice)

    with pytest.raises(services.JobStateError, match="already being cancelled"):
        services.cancel_job(job.pk, by=alice)


# ------------------------------------------------------------------ record_hello


def test_it_relaunches_a_never_started_attempt_on_hello(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)

    commands = services.record_hello(node.pk, hello_data(4, host="node-a")).commands

    [launch] = [parse_command(c) for c in commands]
    assert isinstance(launch, protocol.JobLaunch)
    assert (launch.data.attempt_id, launch.data.job_id) == (attempt.pk, job.pk)
    gpu = attempt.allocations.first().gpu
    gpu.refresh_from_db()
    assert launch.data.gpu_uuids == [gpu.uuid]  # the uuid the hello just reported


def test_it_does_not_relaunch_an_attempt_the_agent_runs(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    hello = hello_data(4, host="node-a").model_copy(
        update={"running": [protocol.RunningJob(attempt_id=attempt.pk, job_id=job.pk)]}
    )

    commands = services.record_hello(node.pk, hello).commands

    assert commands == []


def test_it_kills_an_attempt_the_portal_has_ended_as_stale(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    services.finish_attempt(node.pk, exited_data(attempt, None, reason="lost"))
    hello = hello_data(4, host="node-a").model_copy(
        update={"running": [protocol.RunningJob(attempt_id=attempt.pk, job_id=job.pk)]}
    )

    commands = services.record_hello(node.pk, hello).commands

    [kill] = [parse_command(c) for c in commands]
    assert isinstance(kill, protocol.JobKill)
    assert (kill.data.attempt_id, kill.data.reason) == (attempt.pk, "stale")


def test_it_marks_gpus_missing_from_hello_not_present(cluster: list[Node]) -> None:
    node = cluster[0]

    services.record_hello(node.pk, hello_data(2, host="node-a"))

    present = dict(node.gpus.values_list("index", "present"))
    assert present == {0: True, 1: True, 2: False, 3: False}


def test_it_rejects_a_gpu_already_registered_to_another_node(
    cluster: list[Node],
) -> None:
    node_a, node_b = cluster
    stolen = node_a.gpus.get(index=0)
    hello = hello_data(2, host="node-b")
    gpus = [hello.gpus[0].model_copy(update={"uuid": stolen.uuid}), hello.gpus[1]]

    result = services.record_hello(node_b.pk, hello.model_copy(update={"gpus": gpus}))

    [problem] = result.rejected
    assert stolen.uuid in problem and "node-a" in problem
    stolen.refresh_from_db()
    assert (stolen.node_id, stolen.present) == (node_a.pk, True)
    assert dict(node_b.gpus.values_list("index", "present")) == {0: False, 1: True}


def test_it_brings_a_lost_node_back_up_on_hello(cluster: list[Node]) -> None:
    node = cluster[0]
    Node.objects.filter(pk=node.pk).update(status=Node.Status.LOST, connected=False)

    services.record_hello(node.pk, hello_data(4, host="node-a"))

    node.refresh_from_db()
    assert node.status == Node.Status.UP
    assert node.connected is True


# ------------------------------------------------------------------ mark_lost_nodes


def _after_lost_timeout() -> Any:
    later = timezone.now() + timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER + 5)
    return time_machine.travel(later, tick=False)


def test_it_marks_a_silent_node_lost_and_requeues_its_job(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node_a, node_b = cluster
    job = JobFactory(owner=alice)
    attempt = running(job, node_a)

    with _after_lost_timeout():
        services.record_heartbeat(node_b.pk)
        lost = services.mark_lost_nodes()

    node_a.refresh_from_db()
    node_b.refresh_from_db()
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert lost == [node_a.pk]
    assert (node_a.status, node_a.connected) == (Node.Status.LOST, False)
    assert node_b.status == Node.Status.UP
    assert job.status == Job.Status.PENDING
    assert attempt.outcome == Attempt.Outcome.NODE_LOST
    assert not Allocation.objects.filter(released_at__isnull=True).exists()


@pytest.mark.parametrize("kind", ["jupyter", "shell"])
@pytest.mark.parametrize(
    ("on_loss", "then"), [("requeue", Job.Status.PENDING), ("fail", Job.Status.FAILED)]
)
def test_a_lost_node_ends_an_interactive_job_like_any_job(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    kind: str,
    on_loss: str,
    then: str,
) -> None:
    """Interactive jobs are never preempted or evicted, but a lost node ends their
    attempt as any job's: requeued or failed as the job says, its GPU freed."""
    job = JobFactory(
        owner=alice, interactive=kind, requeue_on_node_loss=on_loss == "requeue"
    )
    attempt = running(job, cluster[0])

    with _after_lost_timeout():
        services.record_heartbeat(cluster[1].pk)
        assert services.mark_lost_nodes() == [cluster[0].pk]

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.status == then
    assert attempt.outcome == Attempt.Outcome.NODE_LOST
    assert attempt.ended_at is not None
    assert not Allocation.objects.filter(released_at__isnull=True).exists()


def test_it_fails_a_job_that_must_not_requeue_when_its_node_is_lost(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice, requeue_on_node_loss=False)
    running(job, cluster[0])

    with _after_lost_timeout():
        services.mark_lost_nodes()

    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert "lost" in job.end_reason
    assert job.finished_at is not None


def test_it_cancels_a_job_being_cancelled_when_its_node_is_lost(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    running(job, cluster[0])
    services.cancel_job(job.pk, by=alice)

    with _after_lost_timeout():
        services.mark_lost_nodes()

    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED


def test_it_handles_a_lost_node_exactly_once(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    running(job, cluster[0])
    with _after_lost_timeout():
        services.mark_lost_nodes()
    events_before = JobEvent.objects.filter(job=job).count()

    with _after_lost_timeout():
        again = services.mark_lost_nodes()

    job.refresh_from_db()
    assert again == []
    assert job.status == Job.Status.PENDING
    assert JobEvent.objects.filter(job=job).count() == events_before


def test_it_keeps_a_node_with_recent_heartbeats(cluster: list[Node]) -> None:
    lost = services.mark_lost_nodes()

    assert lost == []
    assert set(Node.objects.values_list("status", flat=True)) == {Node.Status.UP}


# ------------------------------------------------------------------ append_log


def _log(attempt: Attempt, offset: int, data: str) -> protocol.JobLogData:
    return protocol.JobLogData(
        attempt_id=attempt.pk, job_id=attempt.job_id, offset=offset, data=data
    )


def test_it_stores_log_chunks_once_per_offset(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)

    services.append_log(node.pk, _log(attempt, 0, "epoch 1\n"))
    services.append_log(node.pk, _log(attempt, 8, "epoch 2\n"))
    services.append_log(node.pk, _log(attempt, 0, "epoch 1\n"))

    assert JobLogChunk.objects.filter(attempt=attempt).count() == 2
    assert services.log_tail(job) == "epoch 1\nepoch 2\n"


def test_it_refuses_log_of_another_nodes_attempt(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node_a, node_b = cluster
    attempt = running(JobFactory(owner=alice), node_a)

    stored = services.append_log(node_b.pk, _log(attempt, 0, "forged\n"))

    assert stored is None
    assert not JobLogChunk.objects.exists()


def test_it_caps_the_stored_log(
    alice: User, cluster: list[Node], sent: AgentFrames, settings: Any
) -> None:
    settings.GPULAB_LOG_MAX_BYTES = 10
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)

    services.append_log(node.pk, _log(attempt, 0, "0123456"))
    services.append_log(node.pk, _log(attempt, 7, "789abcdef"))
    last = services.append_log(node.pk, _log(attempt, 16, "more"))

    assert last is None
    assert services.log_tail(job) == "0123456789"


def test_it_caps_the_stored_log_in_bytes(
    alice: User, cluster: list[Node], sent: AgentFrames, settings: Any
) -> None:
    settings.GPULAB_LOG_MAX_BYTES = 10
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)

    services.append_log(node.pk, _log(attempt, 0, "é" * 20))

    assert len(services.log_tail(job).encode("utf-8")) <= 10


def test_it_can_launch_the_longest_command_it_accepts(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.GPULAB_MAX_COMMAND_BYTES = 100 * 1024  # the documented 100 kB limit
    command = "x" * settings.GPULAB_MAX_COMMAND_BYTES
    job = services.submit_job(
        alice, services.JobRequest(name="long", command=command, workdir="/tmp")
    )

    with django_capture_on_commit_callbacks(execute=True):
        start_job(job, cluster[0])

    launch = parse_command(sent.calls()[-1][1])
    assert isinstance(launch, protocol.JobLaunch)
    assert launch.data.command == command
