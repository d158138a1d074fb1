"""Hold and release on the job page: an owner holds and releases their own pending
job; others get 404; an admin's hold is released only by an admin. Nodes show
maintenance apart from draining."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from scheduler import services
from scheduler.models import Job, Node
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def page(user: User, job: Job) -> str:
    return client_for(user).get(reverse("portal-job", args=[job.pk])).content.decode()


def test_the_owner_holds_and_releases_from_the_job_page(alice: User) -> None:
    job = JobFactory(owner=alice)
    client = client_for(alice)
    assert f'action="/jobs/{job.pk}/hold/"' in page(alice, job)

    held = client.post(reverse("portal-job-hold", args=[job.pk]), follow=True)

    job.refresh_from_db()
    body = held.content.decode()
    assert job.status == Job.Status.HELD
    assert f"Job #{job.pk} is held: it waits until released." in body
    assert "held by alice; it waits until released" in body
    assert f'action="/jobs/{job.pk}/release/"' in body
    assert f'action="/jobs/{job.pk}/hold/"' not in body

    client.post(reverse("portal-job-release", args=[job.pk]))

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


@pytest.mark.parametrize("persona", ["bob", "charlie"])
@pytest.mark.parametrize("verb", ["portal-job-hold", "portal-job-release"])
def test_others_get_404(
    request: pytest.FixtureRequest, alice: User, persona: str, verb: str
) -> None:
    job = JobFactory(owner=alice)
    client = client_for(request.getfixturevalue(persona))

    response = client.post(reverse(verb, args=[job.pk]))

    job.refresh_from_db()
    assert response.status_code == 404
    assert job.status == Job.Status.PENDING


def test_hold_and_release_are_post_only(alice: User) -> None:
    job = JobFactory(owner=alice)

    response = client_for(alice).get(reverse("portal-job-hold", args=[job.pk]))

    assert response.status_code == 405


def test_a_running_job_shows_no_hold_and_refuses_it(alice: User) -> None:
    job = JobFactory(owner=alice, status=Job.Status.RUNNING)

    assert "/hold/" not in page(alice, job)
    response = client_for(alice).post(
        reverse("portal-job-hold", args=[job.pk]), follow=True
    )

    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    assert "only a pending job can be held" in response.content.decode()


def test_the_owner_cannot_release_an_admins_hold(alice: User, admin_user: User) -> None:
    admin_user.user_permissions.add(Permission.objects.get(codename="hold_job"))
    job = JobFactory(owner=alice)
    services.hold_job(job.pk, by=admin_user)

    assert "/release/" not in page(alice, job)
    response = client_for(alice).post(
        reverse("portal-job-release", args=[job.pk]), follow=True
    )

    job.refresh_from_db()
    assert job.status == Job.Status.HELD
    assert "only an admin can release it" in response.content.decode()
    assert "/release/" in page(admin_user, job)


def test_nodes_show_maintenance_apart_from_draining(
    alice: User, cluster: list[Node]
) -> None:
    node_a, node_b = cluster
    services.set_node_mode(node_a.pk, "maintenance", by=None)
    services.set_node_mode(node_b.pk, "drain", by=None)

    body = client_for(alice).get(reverse("portal-nodes")).content.decode()
    detail = client_for(alice).get(reverse("portal-node", args=[node_a.pk]))

    assert body.count('class="node status-up mode-maintenance"') == 1
    assert body.count('class="node status-up mode-draining"') == 1
    # their free GPUs are not counted as free: they take no new jobs
    assert body.count("node in maintenance</div>") == 4
    assert body.count("node draining</div>") == 2
    assert "no: in maintenance" in detail.content.decode()
