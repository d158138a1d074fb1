"""Cancelling a job array (issue #27, "Hostile input and bounded cost"): a fixed
number of queries and after-commit calls whatever the number of waiting tasks;
one event per task, the running ones stopped; and on real PostgreSQL
connections, an array cancel racing another cancel cancels each task once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.notifications.models import Delivery
from scheduler import services
from scheduler.models import Attempt, Job, JobEvent
from scheduler.pass_runner import run_one_pass
from scheduler.services import JobRequest
from tests.factories import exited_data, parse_command, started_data
from tests.scheduler.test_console_concurrency import (
    second_while_first_holds_the_lock,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import JobArray, Node
    from tests.capture import AgentFrames


def req() -> JobRequest:
    return JobRequest(name="sweep", command="python sweep.py", workdir="/tmp/w")


def cancel_cost(owner: User, size: int, capture: Any) -> tuple[int, int]:
    """The queries and after-commit callbacks of cancelling a new array of
    ``size`` waiting tasks."""
    array = services.submit_array(owner, req(), f"0-{size - 1}")
    with CaptureQueriesContext(connection) as queries, capture() as callbacks:
        assert len(services.cancel_array(array.pk, by=owner)) == size
    return len(queries), len(callbacks)


@pytest.mark.django_db
def test_an_array_of_200_waiting_tasks_cancels_in_as_many_queries_as_one_of_10(
    alice: User, cluster: list[Node], django_capture_on_commit_callbacks: Any
) -> None:
    small = cancel_cost(alice, 10, django_capture_on_commit_callbacks)
    big = cancel_cost(alice, 200, django_capture_on_commit_callbacks)

    assert big == small
    # per task, cancel_job costs 6 queries: 200 tasks would be over 1,000
    assert small[0] <= 25, small


@pytest.mark.django_db
def test_an_arrays_cancel_ends_each_waiting_task_once_and_stops_the_running_one(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    array = services.submit_array(alice, req(), "0-4%1")
    run_one_pass()
    running = array.tasks.get(status__in=Job.ON_NODE)
    attempt = Attempt.objects.get(job=running)
    held = array.tasks.filter(status=Job.Status.PENDING).order_by("pk").first()
    assert held is not None
    services.hold_job(held.pk, by=alice)
    sent.clear()

    with django_capture_on_commit_callbacks(execute=True):
        cancelled = services.cancel_array(array.pk, by=alice)

    tasks = {t.pk: t for t in array.tasks.all()}
    assert cancelled == sorted(tasks)
    waiting = [t for pk, t in sorted(tasks.items()) if pk != running.pk]
    for task in waiting:
        assert task.status == Job.Status.CANCELLED
        assert task.finished_at == task.cancel_requested_at is not None
        assert task.end_reason == "cancelled by alice"
        assert (task.pending_reason, task.pending_message) == ("", "")
    ends = JobEvent.objects.filter(job__array=array, to_status=Job.Status.CANCELLED)
    assert sorted(ends.values_list("job_id", "from_status", "actor__username")) == [
        (t.pk, "held" if t.pk == held.pk else "pending", "alice") for t in waiting
    ]
    # the running task: asked to stop, one event, one kill; it ends on its exit
    running.refresh_from_db()
    assert running.status in Job.ON_NODE
    assert running.cancel_requested_at is not None
    assert list(
        JobEvent.objects.filter(job=running, to_status="").values_list(
            "message", flat=True
        )
    ) == ["cancel requested by alice; stopping the process"]
    attempt.refresh_from_db()
    assert attempt.kill_reason == "cancelled"
    assert attempt.kill_sent_at is not None
    kills = [parse_command(f) for _, f in sent.of_type("job.kill")]
    assert [(k.data.attempt_id, k.data.reason) for k in kills] == [
        (attempt.pk, "cancelled")
    ]
    node = attempt.node_id
    with django_capture_on_commit_callbacks(execute=True):
        services.mark_started(node, started_data(attempt))
        services.finish_attempt(node, exited_data(attempt, 143))
    running.refresh_from_db()
    assert running.status == Job.Status.CANCELLED
    assert services.cancel_array(array.pk, by=alice) == []


@pytest.mark.django_db
def test_a_batch_with_a_job_whose_state_changed_unseen_writes_nothing(
    alice: User, cluster: list[Node]
) -> None:
    from django.db import transaction

    from scheduler.lifecycle import Cause, ForbiddenTransition
    from scheduler.services.lifecycle import transition_many

    array = services.submit_array(alice, req(), "0-2")
    tasks = list(array.tasks.order_by("pk"))  # read PENDING
    services.hold_job(tasks[1].pk, by=alice)  # changed behind the copies' back

    with pytest.raises(ForbiddenTransition) as refused, transaction.atomic():
        transition_many(
            tasks,
            Job.Status.CANCELLED,
            Cause.CANCEL,
            "cancelled",
            source=JobEvent.Source.USER,
            summary="3 cancelled",
        )

    assert (refused.value.job_id, refused.value.source) == (tasks[1].pk, "held")
    assert list(array.tasks.order_by("pk").values_list("status", flat=True)) == [
        "pending",
        "held",
        "pending",
    ]
    assert not JobEvent.objects.filter(job__array=array, to_status="cancelled")


# ------------------------------------------------------------------ races


def _ended_once(array: JobArray) -> None:
    """Every task of the array CANCELLED, with exactly one event saying so."""
    tasks = list(array.tasks.values_list("pk", "status"))
    assert {status for _, status in tasks} == {Job.Status.CANCELLED}
    ends = JobEvent.objects.filter(job__array=array, to_status=Job.Status.CANCELLED)
    assert sorted(ends.values_list("job_id", flat=True)) == sorted(
        pk for pk, _ in tasks
    )


@pytest.mark.django_db(transaction=True)
def test_an_array_cancel_waiting_on_a_tasks_own_cancel_skips_that_task(
    alice: User, cluster: list[Node]
) -> None:
    array = services.submit_array(alice, req(), "0-9")
    one = array.tasks.order_by("pk")[4]

    cancelled, error = second_while_first_holds_the_lock(
        one.pk,
        lambda: services.cancel_job(one.pk, by=alice),
        lambda: services.cancel_array(array.pk, by=alice),
    )

    assert error is None
    assert len(cancelled) == 9
    assert one.pk not in cancelled
    _ended_once(array)
    # the owner hears of that task once, and of the array's other nine once
    assert sorted(Delivery.objects.values_list("subject", flat=True)) == [
        f"Job #{one.pk} sweep cancelled",
        f"array {array.pk} (sweep): 9 waiting tasks cancelled by alice",
    ]


@pytest.mark.django_db(transaction=True)
def test_a_tasks_cancel_waiting_on_its_arrays_cancel_finds_it_ended(
    alice: User, cluster: list[Node]
) -> None:
    array = services.submit_array(alice, req(), "0-9")
    one = array.tasks.order_by("pk")[4]

    _, error = second_while_first_holds_the_lock(
        one.pk,
        lambda: services.cancel_array(array.pk, by=alice),
        lambda: services.cancel_job(one.pk, by=alice),
    )

    assert isinstance(error, services.JobStateError)
    assert str(error) == f"Job #{one.pk} has already ended (cancelled)."
    _ended_once(array)


@pytest.mark.django_db(transaction=True)
def test_two_cancels_of_one_array_at_once_cancel_each_task_once(
    alice: User, cluster: list[Node]
) -> None:
    array = services.submit_array(alice, req(), "0-9")
    first = array.tasks.order_by("pk")[0]
    done: list[list[int]] = []

    second, error = second_while_first_holds_the_lock(
        first.pk,
        lambda: done.append(services.cancel_array(array.pk, by=alice)),
        lambda: services.cancel_array(array.pk, by=alice),
    )

    assert error is None
    assert (len(done[0]), second) == (10, [])
    _ended_once(array)
