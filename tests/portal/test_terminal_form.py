"""**Open a terminal** (portal/terminal/views.py): the short form submits an
interactive terminal job through the one submission path, and the per-user cap
refuses a second one naming the first; the job page shows the terminal of a
running interactive job to its owner only."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.urls import reverse

from scheduler.models import Job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_open_a_terminal_submits_an_interactive_terminal_job(
    alice: User, cluster: list[Node]
) -> None:
    client = client_for(alice)
    assert "Open a terminal" in client.get(reverse("portal-job-new")).content.decode()
    page = client.get(reverse("portal-terminal-new"))
    assert page.status_code == 200
    assert "Default 2 h, at most 12 h." in page.content.decode()

    response = client.post(
        reverse("portal-terminal-new"), {"gpus": "1", "time_limit_h": "0.5"}
    )
    job = Job.objects.get(owner=alice)
    assert response.status_code == 302
    assert response["Location"] == reverse("portal-job", args=[job.pk])
    assert (job.interactive, job.priority_class, job.time_limit_s) == (
        "shell",
        "interactive",
        1800,
    )

    # Over the cap (one each): refused on the form, naming the job she has.
    again = client.post(reverse("portal-terminal-new"), {"gpus": "1"})
    assert again.status_code == 400
    assert f"#{job.pk}" in again.content.decode()
    assert Job.objects.filter(owner=alice).count() == 1


def test_bad_input_is_named_and_stores_nothing(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).post(
        reverse("portal-terminal-new"), {"gpus": "0", "time_limit_h": "100"}
    )
    assert response.status_code == 400
    body = response.content.decode()
    assert 'id="gpus-error"' in body
    assert not Job.objects.exists()


def test_the_job_page_shows_the_terminal_to_the_owner_only(
    alice: User, bob: User
) -> None:
    from tests.factories import JobFactory

    job = JobFactory(owner=alice, interactive="shell", status=Job.Status.RUNNING)
    mine = client_for(alice).get(reverse("portal-job", args=[job.pk])).content.decode()
    assert 'data-testid="job-terminal"' in mine
    assert "vendor/xterm/xterm.js" in mine
    theirs = client_for(bob).get(reverse("portal-job", args=[job.pk]))
    assert 'data-testid="job-terminal"' not in theirs.content.decode()
    batch = JobFactory(owner=alice, status=Job.Status.RUNNING)
    page = client_for(alice).get(reverse("portal-job", args=[batch.pk]))
    assert 'data-testid="job-terminal"' not in page.content.decode()


def test_the_terminal_names_the_account_the_agent_runs_the_job_as(
    alice: User, cluster: list[Node]
) -> None:
    """alice has no Unix account of her own: the node's agent runs her terminal
    job as its --default-account (``make up`` as root: gpulab-demo). The card
    says so, not her portal name; before the agent's start it names no one."""
    from agents import protocol
    from scheduler import services
    from tests.factories import JobFactory, start_job

    job = JobFactory(owner=alice, interactive="shell")
    attempt = start_job(job, cluster[0])
    page = client_for(alice).get(reverse("portal-job", args=[job.pk])).content.decode()
    assert 'data-testid="job-terminal"' not in page  # starting: no terminal yet

    services.mark_started(
        cluster[0].pk,
        protocol.JobStartedData(
            attempt_id=attempt.pk,
            job_id=job.pk,
            pid=4242,
            started_at=time.time(),
            run_as="gpulab-demo",
        ),
    )
    attempt.refresh_from_db()
    assert attempt.run_as == "gpulab-demo"
    page = client_for(alice).get(reverse("portal-job", args=[job.pk])).content.decode()
    assert 'data-testid="job-terminal"' in page
    assert "A shell on the job's node as <span" in page
    assert '<span data-testid="terminal-account">gpulab-demo</span>' in page
    assert f"node as {alice.get_username()}" not in page
