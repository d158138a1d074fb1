"""The admin console's verbs: hold / release, requeue, priority class, node modes.
Each transition, its wrong-state error, who may do it, and that the policy never
starts a held job or a job on a node in maintenance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import PermissionDenied

from scheduler import pass_requests, pass_runner, policy, services
from scheduler.models import Attempt, Job, JobEvent, Node
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.capture import AgentFrames, Broker

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(admin_user: User) -> User:
    """Staff with the console's job and node permissions."""
    admin_user.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["hold_job", "requeue_job", "change_job_priority"]
        )
    )
    return admin_user


def last_event(job: Job) -> JobEvent:
    return job.events.order_by("-at", "-id")[0]


def kills(sent: AgentFrames) -> list[tuple[int, str]]:
    """(node id, reason) of every job.kill sent."""
    return [(node, frame["data"]["reason"]) for node, frame in sent.of_type("job.kill")]


# ------------------------------------------------------------------ hold / release


def test_it_holds_a_pending_job(
    alice: User, admin: User, django_capture_on_commit_callbacks: Any
) -> None:
    job = JobFactory(owner=alice, queue_order=3)

    services.hold_job(job.pk, by=admin)

    job.refresh_from_db()
    assert job.status == Job.Status.HELD
    assert job.held_by == admin
    assert (job.queue_order, job.queue_position) == (None, None)
    assert job.pending_reason == "held"
    event = last_event(job)
    assert (event.actor, event.from_status, event.to_status) == (
        admin,
        "pending",
        "held",
    )
    assert event.message == "held by root"


def test_the_owner_may_hold_and_release_their_own_job(alice: User) -> None:
    job = JobFactory(owner=alice)
    submitted = job.submitted_at

    services.hold_job(job.pk, by=alice)
    services.release_job(job.pk, by=alice)

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert job.held_by is None
    assert job.submitted_at == submitted  # its age is kept
    assert last_event(job).message == "released by alice (its age is kept)"


def test_release_asks_for_a_pass(
    alice: User, admin: User, django_capture_on_commit_callbacks: Any, passes: Broker
) -> None:
    job = JobFactory(owner=alice, status=Job.Status.HELD, held_by=admin)

    with django_capture_on_commit_callbacks(execute=True):
        services.release_job(job.pk, by=admin)

    assert passes.passes() == 1


def test_hold_asks_for_a_pass(
    alice: User, admin: User, django_capture_on_commit_callbacks: Any, passes: Broker
) -> None:
    """A held job leaves the queue: the jobs behind it may start now (it may have
    held the reservation), so a pass runs now rather than at beat's next one."""
    job = JobFactory(owner=alice)

    with django_capture_on_commit_callbacks(execute=True):
        services.hold_job(job.pk, by=admin)

    assert passes.passes() == 1


@pytest.mark.parametrize("status", ["pending", "held"])
def test_cancelling_a_waiting_job_asks_for_a_pass(
    alice: User,
    admin: User,
    django_capture_on_commit_callbacks: Any,
    status: str,
    passes: Broker,
) -> None:
    job = JobFactory(owner=alice)
    if status == "held":
        services.hold_job(job.pk, by=admin)
        passes.purge()
        pass_requests._redis_client().delete(
            pass_requests._queued_key()
        )  # the hold's pass

    with django_capture_on_commit_callbacks(execute=True):
        services.cancel_job(job.pk, by=alice)

    assert passes.passes() == 1


def test_the_owner_may_not_release_an_admins_hold(alice: User, admin: User) -> None:
    job = JobFactory(owner=alice)
    services.hold_job(job.pk, by=admin)

    with pytest.raises(PermissionDenied, match="held by an admin"):
        services.release_job(job.pk, by=alice)

    job.refresh_from_db()
    assert job.status == Job.Status.HELD


@pytest.mark.parametrize("persona", ["bob", "charlie"])
def test_others_may_not_hold_a_job(
    request: pytest.FixtureRequest, alice: User, persona: str
) -> None:
    job = JobFactory(owner=alice)

    with pytest.raises(PermissionDenied):
        services.hold_job(job.pk, by=request.getfixturevalue(persona))

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


def test_staff_without_the_permission_may_not_hold_anothers_job(
    alice: User, admin_user: User
) -> None:
    job = JobFactory(owner=alice)

    with pytest.raises(PermissionDenied):
        services.hold_job(job.pk, by=admin_user)


@pytest.mark.parametrize(
    ("status", "message"),
    [
        ("running", "Job #{} is running; only a pending job can be held."),
        ("held", "Job #{} is held; only a pending job can be held."),
        ("completed", "Job #{} has ended (completed); only a pending job can be held."),
    ],
)
def test_it_refuses_to_hold_a_job_not_pending(
    alice: User, admin: User, status: str, message: str
) -> None:
    job = JobFactory(owner=alice, status=status)

    with pytest.raises(services.JobStateError) as exc:
        services.hold_job(job.pk, by=admin)

    assert str(exc.value) == message.format(job.pk)
    job.refresh_from_db()
    assert job.status == status


@pytest.mark.parametrize("status", ["pending", "running", "cancelled"])
def test_it_refuses_to_release_a_job_not_held(
    alice: User, admin: User, status: str
) -> None:
    job = JobFactory(owner=alice, status=status)

    with pytest.raises(services.JobStateError, match="only a held job"):
        services.release_job(job.pk, by=admin)


def test_a_held_job_can_be_cancelled(alice: User, admin: User) -> None:
    job = JobFactory(owner=alice)
    services.hold_job(job.pk, by=admin)

    services.cancel_job(job.pk, by=alice)

    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED


# ------------------------------------------------------------------ the policy


def test_the_pass_never_starts_a_held_job(
    alice: User, admin: User, cluster: list[Node], sent: AgentFrames
) -> None:
    held = JobFactory(owner=alice)
    services.hold_job(held.pk, by=admin)
    other = JobFactory(owner=alice)

    state = services.snapshot().cluster
    pass_runner.run_one_pass()

    assert [j.id for j in state.pending] == [other.pk]
    held.refresh_from_db()
    other.refresh_from_db()
    assert held.status == Job.Status.HELD
    assert held.pending_reason == "held"
    assert other.status == Job.Status.STARTING
    assert not Attempt.objects.filter(job=held).exists()


def test_a_start_decided_before_the_hold_is_skipped(
    alice: User, admin: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    snapshot = services.snapshot()
    decisions = policy.decide(snapshot.cluster)
    assert [d.job_id for d in decisions if isinstance(d, policy.Start)] == [job.pk]

    services.hold_job(job.pk, by=admin)  # between the pass's read and its writes
    result = services.apply_decisions(decisions, snapshot.stored_waits)

    job.refresh_from_db()
    assert result.started == 0
    assert job.status == Job.Status.HELD
    assert not Attempt.objects.filter(job=job).exists()


# ------------------------------------------------------------------ requeue


def test_it_requeues_a_running_job_through_the_kill_path(
    alice: User,
    admin: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    job = JobFactory(owner=alice)
    submitted = job.submitted_at
    attempt = start_job(job, cluster[0])
    services.mark_started(cluster[0].pk, started_data(attempt))
    sent.clear()

    with django_capture_on_commit_callbacks(execute=True):
        services.requeue_job(job.pk, by=admin)

    attempt.refresh_from_db()
    assert attempt.kill_reason == "requeued"
    assert kills(sent) == [(cluster[0].pk, "requeued")]
    assert last_event(job).actor == admin
    assert last_event(job).message == "requeue asked by root; stopping the process"
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING  # until the agent reports the exit

    services.finish_attempt(cluster[0].pk, exited_data(attempt, 143, reason="killed"))

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert job.submitted_at == submitted
    assert job.finished_at is None
    assert job.preemptions == 0
    assert last_event(job).to_status == "pending"
    assert "sent back to the queue by an admin" in last_event(job).message
    assert not job.attempt_set.filter(ended_at__isnull=True).exists()


@pytest.mark.parametrize(
    ("status", "message"),
    [
        ("pending", "Job #{} is pending; only a starting or running job can be"),
        ("held", "Job #{} is held; only a starting or running job can be"),
        ("completed", "Job #{} has ended (completed); an ended job is not requeued"),
        ("failed", "Job #{} has ended (failed); an ended job is not requeued"),
    ],
)
def test_it_refuses_to_requeue_a_job_not_on_a_node(
    alice: User, admin: User, status: str, message: str
) -> None:
    job = JobFactory(owner=alice, status=status)

    with pytest.raises(services.JobStateError) as exc:
        services.requeue_job(job.pk, by=admin)

    assert str(exc.value).startswith(message.format(job.pk))
    job.refresh_from_db()
    assert job.status == status


def test_it_refuses_to_requeue_a_job_being_stopped(
    alice: User, admin: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    attempt = start_job(job, cluster[0])
    Attempt.objects.filter(pk=attempt.pk).update(kill_reason="preempted")

    with pytest.raises(services.JobStateError, match=r"already being stopped \(pre"):
        services.requeue_job(job.pk, by=admin)


def test_it_refuses_to_requeue_a_job_being_cancelled(
    alice: User, admin: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    start_job(job, cluster[0])
    services.cancel_job(job.pk, by=alice)

    with pytest.raises(services.JobStateError, match="is being cancelled"):
        services.requeue_job(job.pk, by=admin)


def test_requeue_and_node_modes_need_their_permissions_in_the_service(
    alice: User, bob: User, cluster: list[Node], sent: AgentFrames
) -> None:
    """The rule lives in the service, so the console and the API share it:
    staff without the permission (bob here) are refused, nothing changes."""
    bob.is_staff = True
    bob.save()
    job = JobFactory(owner=alice)
    attempt = start_job(job, cluster[0])

    with pytest.raises(PermissionDenied, match="requeue_job permission"):
        services.requeue_job(job.pk, by=bob)
    with pytest.raises(PermissionDenied, match="drain_node permission"):
        services.set_node_mode(cluster[0].pk, "drain", by=bob)

    attempt.refresh_from_db()
    cluster[0].refresh_from_db()
    assert (attempt.kill_reason, cluster[0].draining) == ("", False)


# ------------------------------------------------------------------ priority class


@pytest.mark.parametrize("status", ["pending", "held"])
def test_it_changes_a_waiting_jobs_class(
    alice: User,
    admin: User,
    status: str,
    django_capture_on_commit_callbacks: Any,
    passes: Broker,
) -> None:
    job = JobFactory(owner=alice, status=status)

    with django_capture_on_commit_callbacks(execute=True):
        services.set_priority_class(job.pk, "high", by=admin)

    job.refresh_from_db()
    assert job.priority_class == "high"
    assert job.status == status
    assert (
        last_event(job).message == "priority class changed from normal to high by root"
    )
    assert passes.passes() == 1


def test_the_new_class_weighs_in_the_next_pass(alice: User, admin: User) -> None:
    job = JobFactory(owner=alice)

    services.set_priority_class(job.pk, "high", by=admin)

    [pending] = services.snapshot().cluster.pending
    assert pending.priority_weight == 1.0


@pytest.mark.parametrize("status", ["running", "starting", "completed"])
def test_it_refuses_to_change_the_class_of_a_job_not_waiting(
    alice: User, admin: User, status: str
) -> None:
    job = JobFactory(owner=alice, status=status)

    with pytest.raises(services.JobStateError, match="only a pending or held job"):
        services.set_priority_class(job.pk, "high", by=admin)

    job.refresh_from_db()
    assert job.priority_class == "normal"


def test_it_refuses_an_unknown_class(alice: User, admin: User) -> None:
    job = JobFactory(owner=alice)

    with pytest.raises(ValueError, match="Unknown class 'urgent'; choose one of: high"):
        services.set_priority_class(job.pk, "urgent", by=admin)


def test_it_refuses_a_class_whose_limit_is_below_the_jobs(
    alice: User, admin: User
) -> None:
    job = JobFactory(owner=alice, time_limit_s=5 * 24 * 3600)

    with pytest.raises(ValueError, match=r"\(120 h\) is above the high class's max"):
        services.set_priority_class(job.pk, "high", by=admin)

    job.refresh_from_db()
    assert job.priority_class == "normal"


def test_it_refuses_the_class_a_job_already_has(alice: User, admin: User) -> None:
    job = JobFactory(owner=alice)

    with pytest.raises(services.JobStateError, match="already in class normal"):
        services.set_priority_class(job.pk, "normal", by=admin)


# ------------------------------------------------------------------ node modes


@pytest.mark.parametrize("mode", ["drain", "maintenance"])
def test_a_node_drained_or_in_maintenance_takes_no_new_jobs(
    alice: User, cluster: list[Node], mode: Any, sent: AgentFrames
) -> None:
    node_a, node_b = cluster
    services.set_node_mode(node_a.pk, mode, by=None)
    services.set_node_mode(node_b.pk, mode, by=None)
    job = JobFactory(owner=alice)

    views = {n.id: n.schedulable for n in services.snapshot().cluster.nodes}
    pass_runner.run_one_pass()

    job.refresh_from_db()
    assert views == {node_a.pk: False, node_b.pk: False}
    assert job.status == Job.Status.PENDING
    assert "down, draining or in maintenance" in job.pending_message


def test_a_start_decided_before_maintenance_is_skipped(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    snapshot = services.snapshot()
    decisions = policy.decide(snapshot.cluster)
    [start] = [d for d in decisions if isinstance(d, policy.Start)]

    services.set_node_mode(start.placements[0].node_id, "maintenance", by=None)
    result = services.apply_decisions(decisions, snapshot.stored_waits)

    assert result.started == 0
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


def test_resume_clears_drain_and_maintenance_and_asks_for_a_pass(
    cluster: list[Node], django_capture_on_commit_callbacks: Any, passes: Broker
) -> None:
    node = cluster[0]
    services.set_node_mode(node.pk, "drain", by=None)
    services.set_node_mode(node.pk, "maintenance", by=None)

    with django_capture_on_commit_callbacks(execute=True):
        changed = services.set_node_mode(node.pk, "resume", by=None)

    node.refresh_from_db()
    assert changed is True
    assert (node.draining, node.maintenance, node.takes_jobs) == (False, False, True)
    assert passes.passes() == 1


def test_node_modes_report_whether_they_changed_anything(cluster: list[Node]) -> None:
    node = cluster[0]

    assert services.set_node_mode(node.pk, "maintenance", by=None) is True
    assert services.set_node_mode(node.pk, "maintenance", by=None) is False
    node.refresh_from_db()
    assert (node.mode, node.draining) == ("maintenance", False)
    assert services.set_node_mode(node.pk, "resume", by=None) is True
    assert services.set_node_mode(node.pk, "resume", by=None) is False


def test_running_jobs_keep_running_on_a_node_put_in_maintenance(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    job = JobFactory(owner=alice)
    start_job(job, cluster[0])
    sent.clear()

    services.set_node_mode(cluster[0].pk, "maintenance", by=None)

    job.refresh_from_db()
    assert job.status == Job.Status.STARTING
    assert kills(sent) == []
