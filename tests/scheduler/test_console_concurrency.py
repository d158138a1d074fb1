"""Two admins acting on one job at once, on real PostgreSQL connections: the
second waits on the first's row lock, then sees what the first did and refuses
(one hold, one release, one requeue: one kill)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection, transaction

from scheduler import services
from scheduler.models import Job, JobEvent
from tests.conftest import make_node
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.contrib.auth.models import User

    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def admins(groups: dict[str, Any]) -> tuple[User, User]:
    from django.contrib.auth.models import User

    perms = Permission.objects.filter(codename__in=["hold_job", "requeue_job"])
    out = []
    for name in ("ann", "ben"):
        user = User.objects.create_user(name, is_staff=True)
        user.user_permissions.add(*perms)
        out.append(user)
    return out[0], out[1]


def _waiting_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
        )
        row = cursor.fetchone()
    return row is not None and row[0] == "Lock"


def second_while_first_holds_the_lock(
    job_id: int, first: Callable[[], Any], second: Callable[[], Any]
) -> tuple[Any, BaseException | None]:
    """Run ``first`` inside a transaction that holds the job's row lock; start
    ``second`` in another thread (its own connection) and let ``first`` commit
    only once PostgreSQL shows ``second`` waiting on that lock. Returns the
    second's result or error."""
    pid: list[int] = []
    outcome: list[Any] = []
    error: list[BaseException] = []
    ready = threading.Event()

    def run_second() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid.append(cursor.fetchone()[0])  # type: ignore[index]
            ready.set()
            outcome.append(second())
        except BaseException as exc:
            error.append(exc)
        finally:
            ready.set()
            connection.close()

    thread = threading.Thread(target=run_second)
    with transaction.atomic():
        Job.objects.select_for_update().get(pk=job_id)
        first()
        thread.start()
        assert ready.wait(timeout=30)
        assert pid, error
        deadline = threading.Event()
        for _ in range(3000):  # until PostgreSQL reports the wait (at most ~30 s)
            if _waiting_on_a_lock(pid[0]):
                break
            deadline.wait(0.01)
        else:
            pytest.fail("the second admin never waited on the row lock")
    thread.join(timeout=30)
    assert not thread.is_alive()
    return (outcome[0] if outcome else None), (error[0] if error else None)


def test_two_admins_holding_at_once_hold_once(
    alice: User, admins: tuple[User, User]
) -> None:
    ann, ben = admins
    job = JobFactory(owner=alice)

    _, error = second_while_first_holds_the_lock(
        job.pk,
        lambda: services.hold_job(job.pk, by=ann),
        lambda: services.hold_job(job.pk, by=ben),
    )

    assert isinstance(error, services.JobStateError)
    assert str(error) == f"Job #{job.pk} is held; only a pending job can be held."
    job.refresh_from_db()
    assert (job.status, job.held_by) == (Job.Status.HELD, ann)
    assert JobEvent.objects.filter(job=job, to_status="held").count() == 1


def test_a_release_racing_a_cancel_loses(
    alice: User, admins: tuple[User, User]
) -> None:
    ann, _ben = admins
    job = JobFactory(owner=alice, status=Job.Status.HELD, held_by=ann)

    _, error = second_while_first_holds_the_lock(
        job.pk,
        lambda: services.cancel_job(job.pk, by=alice),
        lambda: services.release_job(job.pk, by=ann),
    )

    assert isinstance(error, services.JobStateError)
    assert "has ended (cancelled)" in str(error)
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED


def test_two_admins_requeueing_at_once_send_one_kill(
    alice: User, admins: tuple[User, User], sent: AgentFrames
) -> None:
    ann, ben = admins
    node, _ = make_node("node-a", 2)
    job = JobFactory(owner=alice)
    start_job(job, node)
    sent.clear()

    _, error = second_while_first_holds_the_lock(
        job.pk,
        lambda: services.requeue_job(job.pk, by=ann),
        lambda: services.requeue_job(job.pk, by=ben),
    )

    assert isinstance(error, services.JobStateError)
    assert str(error) == f"Job #{job.pk} is already being stopped (requeued)."
    assert [node for node, _ in sent.of_type("job.kill")] == [node.pk]
