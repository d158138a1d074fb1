"""A running job's expected end on its page and in the API: the pass's rule
(``policy.remaining.expected_end``) on its live attempt, from its reported
progress when it reports any, else its plan or limit."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone

from agents import protocol
from scheduler import services
from scheduler.models import Attempt, Job
from tests.api.conftest import api_for
from tests.factories import JobFactory, start_job, started_data
from tests.portal.test_job_views import client_for

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db

T0 = 0.0  # the attempt's start, an hour before each test (set by the fixture)


@pytest.fixture(autouse=True)
def _started_an_hour_ago() -> None:
    """An hour before the test itself runs, not before the module was imported:
    under pytest-xdist a test may run many minutes after collection."""
    global T0
    T0 = float(int(time.time()) - 3600)


def running_job(alice: User, node: Node, **fields: object) -> tuple[Job, Attempt]:
    job = JobFactory(owner=alice, **fields)
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    return job, attempt


def progress(attempt: Attempt, step: int, at: float, total: int) -> None:
    assert services.record_progress(
        attempt.node_id,
        protocol.JobProgressData(
            attempt_id=attempt.pk, job_id=attempt.job_id, at=at, step=step, total=total
        ),
    )


def shown(when: float) -> str:
    return timezone.localtime(datetime.fromtimestamp(when, tz=UTC)).strftime(
        "%Y-%m-%d %H:%M:%S"
    )


def page_of(user: User, job: Job) -> str:
    got = client_for(user).get(f"/jobs/{job.pk}/")
    assert got.status_code == 200
    return " ".join(got.content.decode().split())


def test_a_job_reporting_progress_ends_when_its_rate_says(
    alice: User, cluster: list[Node]
) -> None:
    job, attempt = running_job(alice, cluster[0], time_limit_s=86400)
    progress(attempt, 100, T0 + 600, 5000)
    progress(attempt, 1900, T0 + 3000, 5000)  # 0.75 steps/s
    end = T0 + 3000 + 3100 / 0.75

    page = page_of(alice, job)
    assert f'Expected end</dt><dd data-testid="expected-end">{shown(end)}' in page
    assert "from its progress" in page
    assert "ends in about 5" in page  # 58-59 min from now, by the test's clock

    body = api_for(alice).get(f"/api/v1/jobs/{job.pk}/").json()
    assert datetime.fromisoformat(body["expected_end"]).timestamp() == pytest.approx(
        end, abs=1e-3
    )
    listed = api_for(alice).get("/api/v1/jobs/").json()
    [row] = [r for r in listed["results"] if r["id"] == job.pk]
    assert row["expected_end"] == body["expected_end"]


def test_progress_never_plans_past_the_limit(alice: User, cluster: list[Node]) -> None:
    job, attempt = running_job(alice, cluster[0], time_limit_s=7200)
    progress(attempt, 100, T0 + 600, 50_000)
    progress(attempt, 200, T0 + 1200, 50_000)  # days to go at this rate

    page = page_of(alice, job)
    assert f"{shown(T0 + 7200)} (ends in about 59m" in page or (
        f"{shown(T0 + 7200)} (ends in about 1h" in page
    )
    assert "at its time limit" in page


@pytest.mark.parametrize(
    ("plan", "predicted", "end_after", "source"),
    [
        ("prediction", 5400, 5400, "by its planned run time"),
        ("limit", 5400, 86400, "at its time limit"),
        ("prediction", 1800, 86400, "at its time limit"),  # outlived its plan
    ],
)
def test_without_progress_the_plan_or_the_limit_is_shown(
    settings,
    alice: User,
    cluster: list[Node],
    plan: str,
    predicted: int,
    end_after: float,
    source: str,
) -> None:
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "backfill_plan": plan}
    job, attempt = running_job(
        alice, cluster[0], time_limit_s=86400, predicted_runtime_s=predicted
    )
    progress(attempt, 100, T0 + 600, 100)  # total reached: the steps say nothing

    page = page_of(alice, job)
    assert f"{shown(T0 + end_after)} (ends in about" in page
    assert source in page


def test_slurm_ignores_progress(settings, alice: User, cluster: list[Node]) -> None:
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "name": "slurm"}
    job, attempt = running_job(alice, cluster[0], time_limit_s=86400)
    progress(attempt, 100, T0 + 600, 5000)
    progress(attempt, 1900, T0 + 3000, 5000)

    assert f"{shown(T0 + 86400)} (ends in about" in page_of(alice, job)


def test_a_job_that_is_not_running_has_no_expected_end(
    alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice)
    assert "Expected end" not in page_of(alice, job)
    assert api_for(alice).get(f"/api/v1/jobs/{job.pk}/").json()["expected_end"] is None
