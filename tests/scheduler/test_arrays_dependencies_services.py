"""Job arrays and dependencies through the services and a real pass (issue 8):
submission (bad input refused whole, writes nothing), the pass's gates on real
rows, GPULAB_ARRAY_INDEX at launch, cancelling an array."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from agents import protocol
from scheduler import services
from scheduler.models import Attempt, Job, JobArray, JobDependency, JobEvent
from scheduler.pass_runner import run_one_pass
from scheduler.services import JobRequest
from tests.factories import JobFactory, exited_data, parse_command, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db


def req(**kw: Any) -> JobRequest:
    return JobRequest(name="sweep", command="python sweep.py", workdir="/tmp/w", **kw)


# ------------------------------------------------------------------ array spec


@pytest.mark.parametrize(
    ("spec", "indexes", "limit", "normal"),
    [
        ("0-4", [0, 1, 2, 3, 4], None, "0-4"),
        ("0-99%8", list(range(100)), 8, "0-99%8"),
        ("1,3,5-7", [1, 3, 5, 6, 7], None, "1,3,5-7"),
        ("0-10:5%1", [0, 5, 10], 1, "0-10:5%1"),
        (" 7 ", [7], None, "7"),
    ],
)
def test_it_parses_array_specs(
    spec: str, indexes: list[int], limit: int | None, normal: str
) -> None:
    assert services.parse_array_spec(spec) == (indexes, limit, normal)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("", "Give the array's indexes"),
        ("0-4%0", "limit after % is a whole number"),
        ("0-4%x", "limit after %"),
        ("4-0", "ends before it starts"),
        ("0-4:0", "step is at least 1"),
        ("a-b", "'a-b' is not an index"),
        ("1,,2", "'' is not an index"),
        ("1,1", "Index 1 is given twice"),
        ("0-1000", "at most 1000 tasks"),
        ("2000000", "indexes go up to 1000000"),
        ("-1", "'-1' is not an index"),
    ],
)
def test_it_names_what_is_wrong_in_an_array_spec(spec: str, says: str) -> None:
    with pytest.raises(ValidationError) as err:
        services.parse_array_spec(spec)
    assert says in err.value.message_dict["array"][0]


# ------------------------------------------------------------------ submit


def test_it_submits_an_array_of_tasks(alice: User, cluster: list[Node]) -> None:
    array = services.submit_array(alice, req(gpus=1), "0-4%2")
    assert (array.size, array.max_running, array.spec) == (5, 2, "0-4%2")
    tasks = list(array.tasks.order_by("array_index"))
    assert [t.array_index for t in tasks] == [0, 1, 2, 3, 4]
    assert {t.status for t in tasks} == {Job.Status.PENDING}
    assert {t.owner_id for t in tasks} == {alice.pk}
    assert JobEvent.objects.filter(job__array=array).count() == 5
    assert "task 3 of array" in JobEvent.objects.get(job=tasks[3]).message


def test_bad_input_to_an_array_is_refused_whole_and_stores_nothing(
    alice: User, cluster: list[Node]
) -> None:
    with pytest.raises(ValidationError) as err:
        services.submit_array(alice, req(gpus=0, after="afterok:999999"), "3-1")
    fields = err.value.message_dict
    assert set(fields) == {"array", "gpus", "after"}
    assert not Job.objects.exists()
    assert not JobArray.objects.exists()


def test_an_array_task_gets_its_index_in_its_environment(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    array = services.submit_array(alice, req(), "5,9")
    with django_capture_on_commit_callbacks(execute=True):
        run_one_pass()
    launches = [parse_command(f) for f in sent.frames()]
    env = {
        m.data.job_id: m.data.env for m in launches if isinstance(m, protocol.JobLaunch)
    }
    by_index = {t.array_index: t.pk for t in array.tasks.all()}
    assert env[by_index[5]]["GPULAB_ARRAY_INDEX"] == "5"
    assert env[by_index[9]]["GPULAB_ARRAY_INDEX"] == "9"
    assert env[by_index[9]]["GPULAB_ARRAY_ID"] == str(array.pk)


# ------------------------------------------------------------------ the pass


def _finish(job: Job, exit_code: int) -> None:
    attempt = Attempt.objects.get(job=job, ended_at__isnull=True)
    assert services.mark_started(attempt.node_id, started_data(attempt))
    assert services.finish_attempt(attempt.node_id, exited_data(attempt, exit_code))


def test_the_pass_runs_at_most_the_limit_of_an_array(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    array = services.submit_array(alice, req(), "0-4%2")
    run_one_pass()
    on_node = list(array.tasks.filter(status__in=Job.ON_NODE))
    assert len(on_node) == 2
    waiting = array.tasks.filter(status=Job.Status.PENDING)
    assert {t.pending_reason for t in waiting} == {"array_limit"}
    _finish(on_node[0], 0)
    run_one_pass()
    assert array.tasks.filter(status__in=Job.ON_NODE).count() == 2
    assert array.tasks.filter(status=Job.Status.COMPLETED).count() == 1


def test_the_pass_waits_for_dependencies_and_names_one_never_met(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    first = services.submit_job(alice, req())
    run_one_pass()
    ok = services.submit_job(alice, req(after=f"afterok:{first.pk}"))
    notok = services.submit_job(alice, req(after=f"afternotok:{first.pk}"))
    anyway = services.submit_job(alice, req(after=str(first.pk)))
    run_one_pass()
    for job in (ok, notok, anyway):
        job.refresh_from_db()
        assert (job.status, job.pending_reason) == ("pending", "dependency")
    assert (
        ok.pending_message == f"waiting for job {first.pk} (starting) to end (afterok)"
    )
    _finish(first, 3)
    run_one_pass()
    for job in (ok, notok, anyway):
        job.refresh_from_db()
    assert (ok.status, ok.pending_reason) == ("pending", "dependency_never")
    assert ok.pending_message == (
        f"can never start: job {first.pk} failed (exit 3) and this job runs after"
        " it with afterok; cancel it"
    )
    assert notok.status in Job.ON_NODE
    assert anyway.status in Job.ON_NODE


def test_a_dependency_on_an_array_waits_for_every_task(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    array = services.submit_array(alice, req(), "0-1")
    after = services.submit_job(alice, req(after=f"afterok:a{array.pk}"))
    assert set(after.dependencies.values_list("depends_on_id", flat=True)) == set(
        array.tasks.values_list("pk", flat=True)
    )
    run_one_pass()
    first, second = array.tasks.order_by("array_index")
    _finish(first, 0)
    run_one_pass()
    after.refresh_from_db()
    assert after.pending_reason == "dependency"
    _finish(second, 0)
    run_one_pass()
    after.refresh_from_db()
    assert after.status in Job.ON_NODE


def test_the_pass_loads_dependencies_in_a_fixed_number_of_queries(
    alice: User, cluster: list[Node]
) -> None:
    done = JobFactory(owner=alice, status=Job.Status.COMPLETED)

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            services.snapshot()
        return len(ctx.captured_queries)

    one = JobFactory(owner=alice)
    JobDependency.objects.create(job=one, depends_on=done, kind="afterok")
    before = count()
    for _ in range(20):
        job = JobFactory(owner=alice)
        JobDependency.objects.create(job=job, depends_on=done, kind="afterok")
        JobDependency.objects.create(job=job, depends_on=one, kind="afterany")
    assert count() == before
    state = services.snapshot().cluster
    deps = {p.id: p.dependencies for p in state.pending}
    assert {d.status for d in deps[one.pk]} == {"completed"}


# ------------------------------------------------------------------ dependencies


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("afterwards:1", "Unknown dependency type 'afterwards'"),
        ("afterok", "names no job after afterok"),
        ("afterok:x", "'x' is not a job id"),
        ("afterok:1,", "Empty clause"),
        ("afterok:1:-2", "'-2' is not a job id"),
    ],
)
def test_it_names_what_is_wrong_in_a_dependency(
    alice: User, cluster: list[Node], text: str, says: str
) -> None:
    with pytest.raises(ValidationError) as err:
        services.submit_job(alice, req(after=text))
    assert says in err.value.message_dict["after"][0]
    assert not Job.objects.exists()


def test_a_job_of_someone_else_cannot_be_a_dependency(
    alice: User, bob: User, admin_user: User, cluster: list[Node]
) -> None:
    theirs = JobFactory(owner=bob)
    with pytest.raises(ValidationError) as err:
        services.submit_job(alice, req(after=f"afterok:{theirs.pk}"))
    assert err.value.message_dict["after"] == [
        f"No such job visible to you: {theirs.pk}."
    ]
    # staff see every job, and may wait for any
    job = services.submit_job(admin_user, req(after=f"afterok:{theirs.pk}"))
    assert job.dependencies.get().depends_on_id == theirs.pk


def test_one_job_named_with_two_types_is_refused(
    alice: User, cluster: list[Node]
) -> None:
    mine = JobFactory(owner=alice)
    with pytest.raises(ValidationError) as err:
        services.submit_job(alice, req(after=f"afterok:{mine.pk},afternotok:{mine.pk}"))
    assert (
        "named with both afterok and afternotok" in err.value.message_dict["after"][0]
    )
    assert Job.objects.count() == 1


# ------------------------------------------------------------------ cancel


def test_cancelling_an_array_cancels_each_active_task_once(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    array = services.submit_array(alice, req(), "0-3%1")
    run_one_pass()
    running = array.tasks.get(status__in=Job.ON_NODE)
    single = array.tasks.filter(status=Job.Status.PENDING).order_by("pk").first()
    assert single is not None
    services.cancel_job(single.pk, by=alice)
    with django_capture_on_commit_callbacks(execute=True):
        cancelled = services.cancel_array(array.pk, by=alice)
    assert single.pk not in cancelled
    assert running.pk in cancelled
    assert len(cancelled) == 3
    assert array.tasks.filter(status=Job.Status.CANCELLED).count() == 3
    running.refresh_from_db()
    assert running.cancel_requested_at is not None  # ends when its agent says so
    kills = [parse_command(f) for _, f in sent.of_type("job.kill")]
    assert [k.data.job_id for k in kills] == [running.pk]
    assert services.cancel_array(array.pk, by=alice) == []


def test_cancelling_an_array_of_waiting_tasks_asks_for_one_pass(
    alice: User,
    cluster: list[Node],
    django_capture_on_commit_callbacks: Any,
) -> None:
    from scheduler.services.common import request_pass

    array = services.submit_array(alice, req(), "0-9")
    with django_capture_on_commit_callbacks() as callbacks:
        assert len(services.cancel_array(array.pk, by=alice)) == 10
    assert callbacks.count(request_pass) == 1  # not one per task
