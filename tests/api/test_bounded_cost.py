"""Every range a user can ask for has a bounded cost: usage (API, page, CSV) spans
at most GPULAB_USAGE_MAX_DAYS, lists come a page at a time, and the calendar's
first and last days overflow nowhere (issue #27, "Every request has a bounded
cost"). The Usage page and CSV export's limits are tested in
tests/accounting/test_usage_limits.py; the cost figures are bench/bounded_cost.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client

from scheduler.models import Job
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db

# ------------------------------------------------------------------ usage API


def test_a_usage_range_wider_than_the_limit_is_a_400_naming_it(
    as_alice: Api, settings: Any
) -> None:
    settings.GPULAB_USAGE_MAX_DAYS = 31

    got = as_alice.get("/api/v1/usage/", **{"from": "2027-01-01", "to": "2027-02-01"})

    assert got.status_code == 400
    body = got.json()
    assert body["error"] == "invalid"
    [message] = body["fields"]["to"]
    assert "32 days" in message and "at most 31 days" in message
    assert "GPULAB_USAGE_MAX_DAYS" in message


def test_a_usage_range_of_exactly_the_limit_is_answered(
    as_alice: Api, settings: Any
) -> None:
    settings.GPULAB_USAGE_MAX_DAYS = 31

    got = as_alice.get("/api/v1/usage/", **{"from": "2027-01-01", "to": "2027-01-31"})

    assert got.status_code == 200, got.content
    assert len(got.json()["days"]) == 31


def test_the_attack_range_is_refused_at_once(as_alice: Api) -> None:
    got = as_alice.get("/api/v1/usage/", **{"from": "0001-01-01", "to": "9999-12-31"})

    assert got.status_code == 400
    assert "at most 366 days" in got.json()["fields"]["to"][0]


@pytest.mark.parametrize(
    ("first", "last"), [("0001-01-01", "0001-01-31"), ("9999-12-01", "9999-12-31")]
)
def test_usage_at_the_ends_of_the_calendar_is_empty_not_an_error(
    as_alice: Api, *, first: str, last: str
) -> None:
    got = as_alice.get("/api/v1/usage/", **{"from": first, "to": last})

    assert got.status_code == 200, got.content
    body = got.json()
    assert (body["first"], body["last"], body["gpu_hours"]) == (first, last, 0)


def test_the_schema_states_the_usage_limit() -> None:
    schema = Client().get("/api/v1/schema/", headers={"Accept": "application/json"})
    params = {
        p["name"]: p
        for p in schema.json()["paths"]["/api/v1/usage/"]["get"]["parameters"]
    }
    assert "at most 366 days" in params["to"]["description"]


# ------------------------------------------------------------------ lists


def test_the_queue_comes_a_page_at_a_time(
    alice: User, as_bob: Api, cluster: list[Node]
) -> None:
    running = JobFactory(owner=alice)
    start_job(running, cluster[1])
    waiting = [JobFactory(owner=alice, queue_order=n) for n in range(5)]

    first = as_bob.get("/api/v1/queue/", limit=4)

    assert first.status_code == 200
    assert [j["id"] for j in first.json()] == [running.pk] + [j.pk for j in waiting[:3]]
    assert first["X-Total-Count"] == "6"
    assert [j["queue_position"] for j in first.json()] == [None, 1, 2, 3]
    link = first["Link"]
    assert link.endswith('>; rel="next"') and "offset=4" in link
    second = as_bob.get("/api/v1/queue/", limit=4, offset=4)
    assert [(j["id"], j["queue_position"]) for j in second.json()] == [
        (waiting[3].pk, 4),
        (waiting[4].pk, 5),
    ]
    assert "Link" not in second


def test_the_queue_page_has_a_maximum(as_bob: Api, settings: Any) -> None:
    got = as_bob.get("/api/v1/queue/", limit=settings.GPULAB_API_MAX_PAGE + 1)

    assert got.status_code == 400
    assert got.json()["fields"]["limit"] == [
        f"Ensure this value is less than or equal to {settings.GPULAB_API_MAX_PAGE}."
    ]


def test_the_job_list_page_and_offset_have_a_maximum(
    as_alice: Api, settings: Any
) -> None:
    too_big = as_alice.get("/api/v1/jobs/", limit=settings.GPULAB_API_MAX_PAGE + 1)
    too_deep = as_alice.get("/api/v1/jobs/", offset=settings.GPULAB_API_MAX_OFFSET + 1)

    assert too_big.status_code == 400 and "limit" in too_big.json()["fields"]
    assert too_deep.status_code == 400 and "offset" in too_deep.json()["fields"]


@pytest.mark.parametrize(
    ("zone", "since", "until"),
    [
        ("UTC", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z"),
        ("UTC", "0001-01-01T00:00:00", "9999-12-31T23:59:59"),
        ("Europe/Berlin", "0001-01-01T00:00:00-12:00", "9999-12-31T23:59:59+14:00"),
        ("America/New_York", "0001-01-01T00:00:00-12:00", "9999-12-31T23:59:59+14:00"),
    ],
)
def test_job_list_times_at_the_ends_of_the_calendar_are_answered(
    as_alice: Api, alice: User, settings: Any, *, zone: str, since: str, until: str
) -> None:
    settings.TIME_ZONE = zone
    job = JobFactory(owner=alice, status=Job.Status.PENDING)

    got = as_alice.get("/api/v1/jobs/", since=since, until=until)

    assert got.status_code == 200, got.content
    assert [j["id"] for j in got.json()["results"]] == [job.pk]


@pytest.mark.parametrize(
    ("zone", "field", "value"),
    [
        # a naive time is read in the server's zone: east of UTC, before year 1
        ("Europe/Berlin", "since", "0001-01-01T00:00:00"),
        # west of UTC: after year 9999 (before: both an OverflowError, a 500)
        ("America/New_York", "until", "9999-12-31T23:59:59"),
        # an aware one is shown in the server's zone: beyond the calendar there
        ("Europe/Berlin", "until", "9999-12-31T23:59:59Z"),
        ("America/New_York", "since", "0001-01-01T00:00:00Z"),
    ],
)
def test_job_list_times_beyond_the_calendar_are_a_400_naming_the_field(
    as_alice: Api, settings: Any, *, zone: str, field: str, value: str
) -> None:
    settings.TIME_ZONE = zone

    got = as_alice.get("/api/v1/jobs/", **{field: value})

    assert got.status_code == 400, got.content
    assert list(got.json()["fields"]) == [field]
    assert "out of range" in got.json()["fields"][field][0].lower()


# ------------------------------------------------------------------ logs


def test_a_log_tail_reads_only_the_chunks_it_returns(
    alice: User, as_alice: Api, cluster: list[Node]
) -> None:
    """The tail of a log read every chunk of it (up to GPULAB_LOG_MAX_BYTES, which
    a lab may raise) into the web process to keep the last few."""
    from django.db import connection

    from scheduler import services
    from scheduler.models import Attempt, JobLogChunk
    from scheduler.pass_runner import run_one_pass

    job = services.submit_job(
        alice, services.JobRequest(name="log", command="x", workdir="/tmp")
    )
    run_one_pass()
    attempt = Attempt.objects.get(job=job)
    JobLogChunk.objects.bulk_create(
        JobLogChunk(
            attempt=attempt,
            node_id=attempt.node_id,
            offset=n * 10,
            data=f"line {n:04}\n",
        )
        for n in range(200)
    )
    fetched: list[int] = []

    def count_rows(execute: Any, sql: str, params: Any, many: Any, ctx: Any) -> Any:
        result = execute(sql, params, many, ctx)
        if '"scheduler_joblogchunk"."data"' in sql:  # a read of the text
            fetched.append(ctx["cursor"].rowcount)
        return result

    with connection.execute_wrapper(count_rows):
        got = as_alice.get(f"/api/v1/jobs/{job.pk}/logs/", tail=25)

    assert got.status_code == 200, got.content
    body = got.json()
    assert body["data"] == ("line 0197\nline 0198\nline 0199\n")[-25:]
    assert (body["offset"], body["next_offset"]) == (2000 - 25, 2000)
    assert fetched == [3]  # the last three chunks hold the 25 bytes
