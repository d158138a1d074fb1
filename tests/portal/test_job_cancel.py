"""The cancel button: POST only, CSRF-protected, only for the owner and admins
with cancel_any_job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client
from django.urls import reverse

from scheduler.models import Job
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_job(alice: User) -> Job:
    return JobFactory(owner=alice)


def client_for(user: User, **kwargs: Any) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def cancel_url(job: Job) -> str:
    return reverse("portal-job-cancel", args=[job.pk])


def test_it_cancels_the_owners_pending_job(alice: User, alice_job: Job) -> None:
    response = client_for(alice).post(cancel_url(alice_job))

    alice_job.refresh_from_db()
    assert response.status_code == 302
    assert response.url == reverse("portal-job", args=[alice_job.pk])
    assert alice_job.status == Job.Status.CANCELLED
    assert alice_job.end_reason == "cancelled by alice"


@pytest.mark.parametrize("persona", ["bob", "charlie"])
def test_it_gives_others_404_and_leaves_the_job(
    request: pytest.FixtureRequest, alice_job: Job, persona: str
) -> None:
    client = client_for(request.getfixturevalue(persona))

    response = client.post(cancel_url(alice_job))

    alice_job.refresh_from_db()
    assert response.status_code == 404
    assert alice_job.status == Job.Status.PENDING
    assert alice_job.cancel_requested_at is None


def test_staff_cancel_any_job_with_the_consoles_permission(
    admin_user: User, alice_job: Job
) -> None:
    from django.contrib.auth.models import Permission

    client = client_for(admin_user)
    page = client.get(reverse("portal-job", args=[alice_job.pk])).content.decode()
    assert f'action="{cancel_url(alice_job)}"' not in page
    refused = client.post(cancel_url(alice_job), follow=True)
    assert "cannot be cancelled" in refused.content.decode()
    alice_job.refresh_from_db()
    assert alice_job.status == Job.Status.PENDING

    admin_user.user_permissions.add(Permission.objects.get(codename="cancel_any_job"))
    client = client_for(admin_user)
    page = client.get(reverse("portal-job", args=[alice_job.pk])).content.decode()
    assert f'action="{cancel_url(alice_job)}"' in page
    response = client.post(cancel_url(alice_job))

    alice_job.refresh_from_db()
    assert response.status_code == 302
    assert alice_job.status == Job.Status.CANCELLED
    assert alice_job.end_reason == "cancelled by root"


def test_it_sends_anonymous_users_to_login(db: None, alice_job: Job) -> None:
    response = Client().post(cancel_url(alice_job))

    alice_job.refresh_from_db()
    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))
    assert alice_job.status == Job.Status.PENDING


def test_it_refuses_get(alice: User, alice_job: Job) -> None:
    response = client_for(alice).get(cancel_url(alice_job))

    alice_job.refresh_from_db()
    assert response.status_code == 405
    assert alice_job.status == Job.Status.PENDING


def test_it_refuses_a_post_without_csrf_token(alice: User, alice_job: Job) -> None:
    response = client_for(alice, enforce_csrf_checks=True).post(cancel_url(alice_job))

    alice_job.refresh_from_db()
    assert response.status_code == 403
    assert alice_job.status == Job.Status.PENDING


def test_it_accepts_a_post_with_the_pages_csrf_token(
    alice: User, alice_job: Job
) -> None:
    client = client_for(alice, enforce_csrf_checks=True)
    page = client.get(reverse("portal-job", args=[alice_job.pk]))
    token = page.context["csrf_token"]

    response = client.post(cancel_url(alice_job), {"csrfmiddlewaretoken": token})

    alice_job.refresh_from_db()
    assert response.status_code == 302
    assert alice_job.status == Job.Status.CANCELLED


def test_it_says_an_ended_job_cannot_be_cancelled(alice: User) -> None:
    job = JobFactory(owner=alice, status=Job.Status.COMPLETED)

    response = client_for(alice).post(cancel_url(job), follow=True)

    job.refresh_from_db()
    assert job.status == Job.Status.COMPLETED
    assert f"Job #{job.pk} cannot be cancelled now." in response.content.decode()


def test_it_asks_the_agent_to_stop_a_running_job(
    alice: User,
    alice_job: Job,
    cluster: list[Node],
    django_capture_on_commit_callbacks: Any,
    sent: AgentFrames,
) -> None:
    attempt = start_job(alice_job, cluster[0])
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        response = client_for(alice).post(cancel_url(alice_job))

    alice_job.refresh_from_db()
    assert response.status_code == 302
    assert alice_job.status == Job.Status.STARTING
    assert alice_job.cancel_requested_at is not None
    [(node_id, command)] = sent.calls()
    assert node_id == cluster[0].pk
    assert command["type"] == "job.kill"
    assert command["data"]["attempt_id"] == attempt.pk
