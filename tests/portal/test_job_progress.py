"""The job page shows the progress the job reports: step, total, percent and rate,
on the page and in its polled live fragment; nothing before any report."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.urls import reverse

from agents import protocol
from portal.templatetags.gpulab import progress
from scheduler import services
from scheduler.models import Attempt
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Job, Node

pytestmark = pytest.mark.django_db

T0 = float(int(time.time()) - 3600)


@pytest.fixture
def job(alice: User) -> Job:
    return JobFactory(owner=alice, name="resnet")


@pytest.fixture
def attempt(job: Job, cluster: list[Node]) -> Attempt:
    return start_job(job, cluster[0])


def report(attempt: Attempt, step: int, seconds: float, total: int | None) -> None:
    services.record_progress(
        attempt.node_id,
        protocol.JobProgressData(
            attempt_id=attempt.pk,
            job_id=attempt.job_id,
            at=T0 + seconds,
            step=step,
            total=total,
        ),
    )


def page(user: User, job: Job, *, htmx: bool = False) -> str:
    client = Client()
    client.force_login(user)
    headers = {"HX-Request": "true"} if htmx else {}
    response = client.get(reverse("portal-job", args=[job.pk]), headers=headers)
    assert response.status_code == 200
    return " ".join(response.content.decode().split())


@pytest.mark.parametrize("where", ["page", "live-fragment"])
def test_it_shows_step_total_percent_and_rate(
    alice: User, job: Job, attempt: Attempt, where: str
) -> None:
    report(attempt, 1000, 0, 5000)
    report(attempt, 1200, 62.5, 5000)

    body = page(alice, job, htmx=where == "live-fragment")

    assert "step 1,200 of 5,000 (24%), 3.2 steps/s" in body


def test_it_shows_the_step_and_rate_without_a_total(
    alice: User, job: Job, attempt: Attempt
) -> None:
    report(attempt, 1000, 0, None)
    report(attempt, 1200, 62.5, None)

    assert "step 1,200, 3.2 steps/s" in page(alice, job)


def test_it_shows_the_step_alone_after_one_report(
    alice: User, job: Job, attempt: Attempt
) -> None:
    report(attempt, 7, 0, 10)

    body = page(alice, job)

    assert "step 7 of 10 (70%)" in body
    assert "steps/s" not in body


def test_it_shows_nothing_without_a_report(
    alice: User, job: Job, attempt: Attempt
) -> None:
    body = page(alice, job)

    assert 'data-testid="progress"' not in body
    assert "Progress" not in body


@pytest.mark.parametrize(
    ("step", "total", "rate", "shown"),
    [
        (None, None, None, ""),
        (0, None, None, "step 0"),
        (1200, 5000, 3.2, "step 1,200 of 5,000 (24%), 3.2 steps/s"),
        (4999, 5000, None, "step 4,999 of 5,000 (99%)"),  # 100% only when done
        (5000, 5000, None, "step 5,000 of 5,000 (100%)"),
        (12, 10, None, "step 12 of 10 (120%)"),
        (3, 0, None, "step 3 of 0"),  # no percent of nothing
        (10, None, 1234.5, "step 10, 1,234 steps/s"),
        (10, None, 12.34, "step 10, 12.3 steps/s"),
        (10, None, 0.05, "step 10, 0.05 steps/s"),
        (10, None, 0.0123, "step 10, 0.012 steps/s"),
        (10, None, 0.0, "step 10, 0 steps/s"),
    ],
)
def test_the_progress_text(
    step: int | None, total: int | None, rate: float | None, shown: str
) -> None:
    attempt = Attempt(progress_step=step, progress_total=total)
    if rate is not None:
        assert step is not None
        # Reports over 10,000 s at ``rate`` steps/s, ending at ``step``.
        attempt.progress_at = datetime(2026, 1, 1, tzinfo=UTC)
        attempt.progress_first_at = attempt.progress_at - timedelta(seconds=10_000)
        attempt.progress_first_step = step - round(rate * 10_000)

    assert progress(attempt) == shown
