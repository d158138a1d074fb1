"""A job's page and its events API show at most GPULAB_JOB_EVENTS_MAX events,
the latest, and the page says how many earlier ones it leaves out: a history
grows with every hold and release, and the page rendered all of it (issue #27,
"Every request has a bounded cost")."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.utils import timezone

from scheduler.models import JobEvent
from tests.api.conftest import api_for
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

    from scheduler.models import Job

pytestmark = pytest.mark.django_db


def _history(job: Job, count: int) -> None:
    t0 = timezone.now() - timedelta(hours=1)
    JobEvent.objects.bulk_create(
        JobEvent(
            job=job,
            at=t0 + timedelta(seconds=n),
            source=JobEvent.Source.USER,
            message=f"event {n}",
        )
        for n in range(count)
    )


def test_the_job_page_shows_the_latest_events_and_says_how_many_are_left_out(
    client: Client, alice: User, settings: Any
) -> None:
    settings.GPULAB_JOB_EVENTS_MAX = 10
    job = JobFactory(owner=alice)
    _history(job, 25)
    client.force_login(alice)

    page = client.get(f"/jobs/{job.pk}/")

    assert page.status_code == 200
    shown = [e.message for e in page.context["events"]]
    assert shown == [f"event {n}" for n in range(15, 25)]
    text = page.content.decode()
    assert "15 earlier events not shown: the latest 10 are." in text
    assert "event 14<" not in text and "event 24" in text


def test_a_short_history_is_shown_whole_without_a_note(
    client: Client, alice: User, settings: Any
) -> None:
    settings.GPULAB_JOB_EVENTS_MAX = 10
    job = JobFactory(owner=alice)
    _history(job, 10)
    client.force_login(alice)

    page = client.get(f"/jobs/{job.pk}/")

    assert len(page.context["events"]) == 10
    assert 'data-testid="events-earlier"' not in page.content.decode()


def test_the_events_api_keeps_to_the_same_limit(alice: User, settings: Any) -> None:
    settings.GPULAB_JOB_EVENTS_MAX = 10
    job = JobFactory(owner=alice)
    _history(job, 25)

    got = api_for(alice).get(f"/api/v1/jobs/{job.pk}/events/")

    assert got.status_code == 200
    assert [e["message"] for e in got.json()] == [f"event {n}" for n in range(15, 25)]
