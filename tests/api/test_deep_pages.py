"""A deep page of the job list or the queue costs about what a first one does
(issue #27, "Every request has a bounded cost"): the jobs skipped by ``offset``
are skipped as ids (``views.common.page_of``), and the page holds exactly the
jobs a plain ``queryset[offset : offset + limit]`` would, in its order, also
where jobs tie on every key but the id. The figures are bench/bounded_cost.py's."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from scheduler.models import Job, Membership
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db

# (offset, limit) pairs: the first page, pages across each other's edges, the
# last partial page, one past the end, single jobs.
PAGES = [(0, 5), (3, 5), (5, 5), (7, 4), (1, 1), (12, 3), (17, 10), (40, 5), (0, 100)]


def page_queries(api: Api, path: str, **params: Any) -> tuple[Any, list[str]]:
    """One page and the SQL it ran, the token's use already stamped."""
    api.get("/api/v1/me/")
    with CaptureQueriesContext(connection) as captured:
        got = api.get(path, **params)
    assert got.status_code == 200, got.content
    return got, [q["sql"] for q in captured.captured_queries]


def reads_whole_jobs(sql: str) -> bool:
    """Whether a query reads jobs' rows as the serializer wants them."""
    return '"scheduler_job"."command"' in sql


def test_a_job_list_page_is_the_plain_slice_of_the_visible_jobs(
    alice: User, bob: User, charlie: User, as_bob: Api
) -> None:
    """bob leads alice's group: he sees his jobs and the group's, not charlie's,
    whatever the page; each page's items are the full list's, in its order."""
    Membership.objects.filter(user=bob).update(is_leader=True)
    for i in range(6):
        JobFactory(owner=alice, name=f"a{i}")
        JobFactory(owner=charlie, name=f"c{i}")
        JobFactory(owner=bob, name=f"b{i}")
        JobFactory(owner=alice, name=f"a{i}-failed", status=Job.Status.FAILED)
    visible = list(
        Job.objects.filter(owner__in=[alice, bob])
        .order_by("-id")
        .values_list("pk", flat=True)
    )
    assert len(visible) == 18
    whole = as_bob.get("/api/v1/jobs/", limit=1000).json()["results"]
    assert [j["id"] for j in whole] == visible

    for offset, limit in PAGES:
        page = as_bob.get("/api/v1/jobs/", offset=offset, limit=limit).json()
        assert page["count"] == 18
        assert page["results"] == whole[offset : offset + limit], (offset, limit)
        assert (page["next"] is not None) == (offset + limit < 18)
        assert (page["previous"] is not None) == (offset > 0)

    pending = as_bob.get("/api/v1/jobs/", state="pending", offset=2, limit=5).json()
    assert [j["id"] for j in pending["results"]] == [
        j["id"] for j in whole if j["state"] == "pending"
    ][2:7]


def test_a_deep_job_list_page_skips_ids_not_whole_jobs(
    alice: User, as_alice: Api
) -> None:
    """The one query that reads the page's jobs picks them with an id-only
    subquery that holds the LIMIT and OFFSET: the jobs skipped are never read
    whole nor joined to their owner, group and holder."""
    jobs = [JobFactory(owner=alice) for _ in range(15)]

    got, sqls = page_queries(as_alice, "/api/v1/jobs/", offset=7, limit=5)

    assert [j["id"] for j in got.json()["results"]] == [j.pk for j in reversed(jobs)][
        7:12
    ]
    [sql] = [q for q in sqls if reads_whole_jobs(q)]
    subquery = re.search(
        r'"scheduler_job"\."id" = ANY\(\(ARRAY\('
        r'SELECT U0\."id" AS "pk" FROM "scheduler_job" U0 '
        r"(?P<body>.*?) LIMIT 5 OFFSET 7\)\)\)",
        sql,
    )
    assert subquery is not None, sql
    assert "JOIN" not in subquery["body"]  # the owner's name is not read to skip
    assert "OFFSET" not in sql[subquery.end() :]


@pytest.fixture
def tied_queue(alice: User, bob: User, cluster: list[Node]) -> list[int]:
    """Three running jobs started at the same moment, then waiting jobs that
    tie on the last pass's order and on the moment of submission (and some no
    pass has placed yet, last): the queue's order in full, as ids."""
    now = timezone.now()
    running = [JobFactory(owner=alice, gpus=1) for _ in range(3)]
    for job in running:
        start_job(job, cluster[0])
    Job.objects.filter(pk__in=[j.pk for j in running]).update(started_at=now)
    waiting = [
        JobFactory(owner=owner, queue_order=order)
        for order in (2, 1, 2, None, 1, 2, None, 1, 2, None, 1)
        for owner in (alice, bob)
    ]
    Job.objects.filter(pk__in=[j.pk for j in waiting]).update(
        submitted_at=now - timedelta(minutes=5)
    )
    running_ids = list(
        Job.objects.filter(status__in=Job.ON_NODE)
        .order_by("started_at", "id")
        .values_list("pk", flat=True)
    )
    waiting_ids = list(Job.objects.in_queue_order().values_list("pk", flat=True))
    assert (len(running_ids), len(waiting_ids)) == (3, 22)
    return running_ids + waiting_ids


def test_a_queue_page_is_the_plain_slice_of_the_queue_with_ties(
    tied_queue: list[int], as_bob: Api
) -> None:
    whole = as_bob.get("/api/v1/queue/").json()
    assert [j["id"] for j in whole] == tied_queue
    # placed by the last pass: a place; not yet: none (and last)
    assert [j["queue_position"] for j in whole] == [
        *[None] * 3,
        *range(1, 17),
        *[None] * 6,
    ]

    for offset, limit in [*PAGES, (2, 2), (3, 19), (24, 1), (25, 1)]:
        page = as_bob.get("/api/v1/queue/", offset=offset, limit=limit)
        assert page.json() == whole[offset : offset + limit], (offset, limit)
        assert ("Link" in page) == (offset + limit < 25)


def test_a_deep_queue_page_skips_ids_not_whole_jobs(
    tied_queue: list[int], as_bob: Api
) -> None:
    got, sqls = page_queries(as_bob, "/api/v1/queue/", offset=5, limit=4)

    assert [j["id"] for j in got.json()] == tied_queue[5:9]
    [sql] = [q for q in sqls if reads_whole_jobs(q)]  # running ones: none here
    assert re.search(
        r'"scheduler_job"\."id" = ANY\(\(ARRAY\('
        r'SELECT U0\."id" AS "pk" FROM "scheduler_job" U0 '
        r"[^()]*LIMIT 4 OFFSET 2\)\)\)",
        sql,
    ), sql


# ------------------------------------------------------------------ cursor


def test_a_cursor_pages_through_the_list_as_offsets_do(
    alice: User, bob: User, charlie: User, as_bob: Api
) -> None:
    """``before`` (the last id of the page before) gives the jobs after it in
    the list, and from a cursor ``next`` is the next cursor: following it lists
    every visible job once, in order, whatever else filters the list."""
    Membership.objects.filter(user=bob).update(is_leader=True)
    for i in range(5):
        JobFactory(owner=alice, name=f"a{i}")
        JobFactory(owner=charlie, name=f"c{i}")
        JobFactory(owner=bob, name=f"b{i}", status=Job.Status.FAILED)
    whole = as_bob.get("/api/v1/jobs/", limit=1000).json()["results"]
    ids = [j["id"] for j in whole]
    assert len(ids) == 10

    first = as_bob.get("/api/v1/jobs/", before=ids[3], limit=4).json()
    assert first["results"] == whole[4:8]
    assert first["count"] == 6  # the jobs below the cursor
    assert first["previous"] is None

    seen, url, pages = [], f"/api/v1/jobs/?before={ids[0] + 1}&limit=3", 0
    while url:
        page = as_bob.client.get(url, headers=as_bob.headers).json()
        assert "offset=0" in url or pages == 0
        seen += page["results"]
        url, pages = page["next"], pages + 1
    assert (seen, pages) == (whole, 4)

    failed = as_bob.get("/api/v1/jobs/", state="failed", before=ids[2], limit=2)
    assert [j["id"] for j in failed.json()["results"]] == [
        j["id"] for j in whole[3:] if j["state"] == "failed"
    ][:2]
    assert f"before={failed.json()['results'][-1]['id']}" in failed.json()["next"]


def test_a_cursors_page_skips_nothing(alice: User, as_alice: Api) -> None:
    jobs = [JobFactory(owner=alice) for _ in range(9)]

    got, sqls = page_queries(as_alice, "/api/v1/jobs/", before=jobs[6].pk, limit=3)

    assert [j["id"] for j in got.json()["results"]] == [
        jobs[5].pk,
        jobs[4].pk,
        jobs[3].pk,
    ]
    [sql] = [q for q in sqls if reads_whole_jobs(q)]
    assert f'U0."id" < {jobs[6].pk}' in sql
    assert "OFFSET" not in sql


@pytest.mark.parametrize("before", ["0", "-3", "x", "1.5", str(2**62 + 1)])
def test_a_bad_cursor_is_a_400_naming_it(as_alice: Api, before: str) -> None:
    got = as_alice.get("/api/v1/jobs/", before=before)

    assert got.status_code == 400
    assert list(got.json()["fields"]) == ["before"]
