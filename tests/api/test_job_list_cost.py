"""The job list costs a constant number of queries whatever the page holds, and
its fast item writer (``serializers.ListedFast``) answers exactly what DRF's
own serializer steps would (issue #27: a page of jobs must be cheap, for its
reader and for everyone sharing the web process with it)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework import serializers as drf

from portal.api import serializers as s
from portal.api.views.common import jobs_for, node_names
from scheduler.models import (
    Attempt,
    Job,
    JobArray,
    JobDependency,
    Membership,
    attach_queue_positions,
)
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db


def every_kind(owner: User, holder: User, node: Node, n: int) -> list[Any]:
    """One job of each shape the serializer reads differently: waiting in the
    queue (two, so their places are counted together), held by someone else,
    running on ``node`` with reported progress as a guest, resumed after a
    requeue (two attempts, work lost, the first one a guest), with a dependency, an array's task, a JupyterLab, a
    cancel asked. ``n`` tells the names apart."""
    now = timezone.now()
    queued = [
        JobFactory(owner=owner, name=f"queued-{n}-{i}", queue_order=1000 * n + i)
        for i in range(2)
    ]
    held = JobFactory(
        owner=owner, name=f"held-{n}", status=Job.Status.HELD, held_by=holder
    )
    running = JobFactory(owner=owner, name=f"running-{n}")
    attempt = start_job(running, node)
    Attempt.objects.filter(pk=attempt.pk).update(
        started_at=now - timedelta(minutes=10),
        progress_first_step=10,
        progress_first_at=now - timedelta(minutes=9),
        progress_step=100,
        progress_total=1000,
        progress_at=now - timedelta(minutes=1),
        guest=True,
    )
    Job.objects.filter(pk=running.pk).update(
        status=Job.Status.RUNNING, started_at=now - timedelta(minutes=10)
    )
    resumed = JobFactory(
        owner=owner,
        name=f"resumed-{n}",
        checkpointable=True,
        attempts=2,
        preemptions=1,
        status=Job.Status.COMPLETED,
    )
    Attempt.objects.create(
        job=resumed, number=1, node=node, started_at=now, ended_at=now,
        lost_work_gpu_s=840, guest=True,
    )  # fmt: skip
    Attempt.objects.create(
        job=resumed, number=2, node=node, started_at=now, ended_at=now
    )
    after = JobFactory(owner=owner, name=f"after-{n}")
    JobDependency.objects.create(
        job=after, depends_on=resumed, kind=JobDependency.Kind.AFTEROK
    )
    JobDependency.objects.create(
        job=after, depends_on=held, kind=JobDependency.Kind.AFTERANY
    )
    array = JobArray.objects.create(owner=owner, name=f"sweep-{n}", spec="0", size=1)
    task = JobFactory(owner=owner, name=f"task-{n}", array=array, array_index=0)
    lab = JobFactory(owner=owner, name=f"lab-{n}", interactive="jupyter")
    cancelling = JobFactory(
        owner=owner, name=f"cancelling-{n}", cancel_requested_at=now
    )
    return [*queued, held, running, resumed, after, task, lab, cancelling]


def list_queries(api: Api) -> tuple[int, dict[str, Any]]:
    """The queries of one page of up to 1,000 jobs, and the page; the token's
    use already stamped (at most once a minute: one call in many pays it)."""
    api.get("/api/v1/me/")
    with CaptureQueriesContext(connection) as captured:
        got = api.get("/api/v1/jobs/", limit=1000)
    assert got.status_code == 200, got.content
    return len(captured.captured_queries), got.json()


def test_the_job_list_costs_the_same_queries_for_a_bigger_page(
    alice: User,
    admin_user: User,
    as_alice: Api,
    cluster: list[Node],
    django_assert_max_num_queries: Any,
) -> None:
    every_kind(alice, admin_user, cluster[0], 1)
    few, page = list_queries(as_alice)
    assert page["count"] == 9
    for n in range(2, 5):
        every_kind(alice, admin_user, cluster[0], n)
    # a query per job (its attempts, its dependencies, its restarts) would
    # show here as 27 more
    with django_assert_max_num_queries(few):
        page = as_alice.get("/api/v1/jobs/", limit=1000).json()
    assert page["count"] == 36
    # the token, the led groups, the count, the page, its attempts, its
    # dependencies, the node names, the queue's places
    assert few <= 8


def test_a_leaders_job_list_costs_the_same_queries_as_a_members(
    alice: User,
    bob: User,
    admin_user: User,
    cluster: list[Node],
) -> None:
    from tests.api.conftest import api_for

    Membership.objects.filter(user=bob).update(is_leader=True)
    as_bob = api_for(bob)
    every_kind(alice, admin_user, cluster[0], 1)
    few, page = list_queries(as_bob)
    assert page["count"] == 9  # alice's, in the group bob leads
    every_kind(alice, admin_user, cluster[0], 2)
    every_kind(bob, admin_user, cluster[0], 3)
    many, page = list_queries(as_bob)
    assert (many, page["count"]) == (few, 27)


def test_the_fast_writer_answers_what_drf_would(
    alice: User, admin_user: User, as_alice: Api, cluster: list[Node]
) -> None:
    every_kind(alice, admin_user, cluster[0], 1)
    _, page = list_queries(as_alice)

    class Request:
        user = alice

    jobs = list(jobs_for(Request()).order_by("-id"))  # type: ignore[arg-type]
    attach_queue_positions(jobs)
    writer = s.JobSerializer(context={"node_names": node_names()})

    def drf_steps(serializer: Any, item: Any) -> Any:
        """DRF's own ``Serializer.to_representation``, nested ones too."""
        out = drf.Serializer.to_representation(serializer, item)
        deps = serializer.fields["dependencies"].child
        out["dependencies"] = [
            drf.Serializer.to_representation(deps, d) for d in item.dependency_list
        ]
        return out

    expected = [drf_steps(writer, job) for job in jobs]
    # the API's answer, but for the times that move with the clock
    for item in [*expected, *page["results"]]:
        item.pop("expected_end")
    assert page["results"] == expected
    by_name = {j["name"]: j for j in page["results"]}
    # and what each shape shows is what it is
    assert by_name["held-1"]["held_by"] == "root"
    assert by_name["running-1"]["nodes"] == ["node-a"]
    # a guest while its guest attempt runs, not after it
    assert [name for name, j in by_name.items() if j["guest"]] == ["running-1"]
    assert (
        by_name["resumed-1"]["restarts"],
        by_name["resumed-1"]["lost_work_gpu_s"],
    ) == (1, 840)
    # in the order of the jobs waited for (held was made first)
    assert [(d["type"], d["state"]) for d in by_name["after-1"]["dependencies"]] == [
        ("afterany", "held"),
        ("afterok", "completed"),
    ]
    assert by_name["task-1"]["array_index"] == 0
    assert by_name["lab-1"]["interactive_url"].startswith("/interactive/")
    assert by_name["cancelling-1"]["cancel_requested"] is True
    assert [by_name[f"queued-1-{i}"]["queue_position"] for i in range(2)] == [1, 2]


def test_a_running_jobs_expected_end_is_in_the_list(
    alice: User, admin_user: User, as_alice: Api, cluster: list[Node]
) -> None:
    every_kind(alice, admin_user, cluster[0], 1)
    _, page = list_queries(as_alice)
    ends = {j["name"]: j["expected_end"] for j in page["results"]}
    assert ends.pop("running-1") is not None  # from its reported progress
    assert set(ends.values()) == {None}


class Broken:
    """An object whose attributes the plain reading cannot settle: a method
    (DRF calls it), a missing attribute on a nullable field (DRF: None), a
    missing step in a dotted source."""

    name = "x"
    owner = None

    def count(self) -> int:
        return 3


class Odd(s.ListedFast):
    name = drf.CharField()
    count = drf.IntegerField()
    missing = drf.CharField(allow_null=True)
    owner = drf.CharField(source="owner.username", allow_null=True)
    whole = drf.SerializerMethodField()

    def get_whole(self, item: Any) -> str:
        return type(item).__name__


def test_the_fast_writer_leaves_to_drf_what_a_plain_reading_cannot_settle() -> None:
    item = Broken()
    want = drf.Serializer.to_representation(Odd(), item)
    assert want == {
        "name": "x",
        "count": 3,
        "missing": None,
        "owner": None,
        "whole": "Broken",
    }
    assert Odd().to_representation(item) == want


def test_the_queue_answers_what_drf_would(
    alice: User, admin_user: User, as_alice: Api, cluster: list[Node]
) -> None:
    from portal.api.views.cluster import QueueEntry
    from portal.api.views.common import attempts_for_nodes

    every_kind(alice, admin_user, cluster[0], 1)
    got = as_alice.get("/api/v1/queue/")
    assert got.status_code == 200, got.content
    running = Job.objects.filter(status__in=Job.ON_NODE).order_by("started_at", "id")
    pending = Job.objects.in_queue_order()
    jobs = [
        *running.prefetch_related(attempts_for_nodes()),
        *pending.prefetch_related(attempts_for_nodes()),
    ]
    attach_queue_positions(jobs[len(running) :], first=1)
    writer = QueueEntry(context={"node_names": node_names()})
    expected = [drf.Serializer.to_representation(writer, job) for job in jobs]
    assert got.json() == expected
    assert [(e["name"], e["nodes"]) for e in expected[:1]] == [
        ("running-1", ["node-a"])
    ]


def test_a_list_item_is_the_detail_key_by_key_for_a_job_with_every_field_set(
    alice: User, admin_user: User, as_alice: Api, cluster: list[Node]
) -> None:
    """The list writes its items from rows (``views.listing``), the detail
    through ``JobSerializer``: for a job with every field set, and one waiting
    in the queue, they answer the same keys in the same order with the same
    values (the list's bytes are the detail's)."""
    now = timezone.now()
    array = JobArray.objects.create(owner=alice, name="sweep", spec="0-1", size=2)
    first = JobFactory(owner=alice, name="first", status=Job.Status.COMPLETED)
    second = JobFactory(owner=alice, name="second", status=Job.Status.FAILED)
    full = JobFactory(
        owner=alice,
        name="full \u00e9 \u2028",
        command="python train.py\n\t--x 'y'",
        workdir="/home/lab/run",
        env={"B": "two words", "A": "1", "EMPTY": ""},
        gpus=2,
        gpu_memory_mib=40_000,
        gpu_model="A100",
        time_limit_s=7200,
        predicted_runtime_s=5400,
        shareable=True,
        slowdown_cap=1.25,
        evictable=False,
        workload="llm",
        kill_grace_s=45,
        requeue_on_node_loss=False,
        interactive="jupyter",
        checkpointable=True,
        checkpoint_signal="USR1",
        checkpoint_grace_s=90,
        exit_code=3,
        end_reason="an end reason",
        pending_reason="resources",
        pending_message="waits for 2 GPUs",
        est_start=now.replace(microsecond=0) + timedelta(hours=1),
        finished_at=now + timedelta(hours=2),
        held_by=admin_user,
        cancel_requested_at=now,
        array=array,
        array_index=1,
        attempts=2,
        preemptions=1,
    )
    JobDependency.objects.create(
        job=full, depends_on=second, kind=JobDependency.Kind.AFTERANY
    )
    JobDependency.objects.create(
        job=full, depends_on=first, kind=JobDependency.Kind.AFTEROK
    )
    Attempt.objects.create(
        job=full, number=1, node=cluster[0], started_at=now - timedelta(hours=1),
        ended_at=now - timedelta(minutes=30), lost_work_gpu_s=600,
    )  # fmt: skip
    Attempt.objects.create(
        job=full, number=2, node=cluster[0], started_at=now - timedelta(minutes=20),
        ranks=[cluster[1].pk, cluster[0].pk],
    )  # fmt: skip
    Job.objects.filter(pk=full.pk).update(
        status=Job.Status.RUNNING, started_at=now - timedelta(minutes=20)
    )
    waiting = [
        JobFactory(owner=alice, name=f"waiting-{i}", queue_order=i) for i in range(2)
    ]
    page = as_alice.get("/api/v1/jobs/", limit=1000)
    assert page.status_code == 200, page.content
    listed = {item["id"]: item for item in page.json()["results"]}
    for job in (full, *waiting):
        detail = as_alice.get(f"/api/v1/jobs/{job.pk}/").json()
        assert list(listed[job.pk]) == list(s.JobSerializer().fields)
        for key, value in detail.items():
            assert (key, listed[job.pk][key]) == (key, value)
        assert list(listed[job.pk]) == list(detail)
    item = listed[full.pk]
    # each field set shows as set (a column read for another would not)
    assert None not in [v for k, v in item.items() if k != "queue_position"]
    assert [d["job"] for d in item["dependencies"]] == [first.pk, second.pk]
    assert list(item["dependencies"][0]) == list(s.DependencyOut().fields)
    assert item["nodes"] == [cluster[1].name, cluster[0].name]
    assert (item["restarts"], item["lost_work_gpu_s"]) == (1, 600)
    # a time without microseconds is written without them; UTC as Z
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", item["est_start"])
    assert re.fullmatch(r".*T.*\.\d{6}Z", item["finished_at"])
    assert [listed[j.pk]["queue_position"] for j in waiting] == [1, 2]
