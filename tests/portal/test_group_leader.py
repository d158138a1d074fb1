"""A group's leader sees the group's jobs (issue 6: "leaders, who see their
group's usage and jobs"), read only; another group's leader, or a member who
leads nothing, sees none of them; the Usage page's top jobs link to pages the
leader may open (tests/accounting/test_usage_pages.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from scheduler.models import Job, Membership
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

pytestmark = pytest.mark.django_db


def lead(user: User, group: str) -> None:
    Membership.objects.filter(user=user, group__name=group).update(is_leader=True)


@pytest.mark.parametrize(
    ("persona", "leads", "sees"),
    [
        ("bob", "vision", True),  # leads alice's group
        ("bob", None, False),  # same group, leads nothing
        ("charlie", "nlp", False),  # leads another group
    ],
)
def test_who_sees_a_members_job(
    request: pytest.FixtureRequest,
    client: Client,
    alice: User,
    persona: str,
    leads: str | None,
    *,
    sees: bool,
) -> None:
    user = request.getfixturevalue(persona)
    if leads:
        lead(user, leads)
    job = JobFactory(owner=alice, name="alices-run")
    client.force_login(user)

    page = client.get(f"/jobs/{job.pk}/")
    listed = "alices-run" in client.get("/jobs/").content.decode()

    assert page.status_code == (200 if sees else 404)
    assert listed is sees


def test_a_leader_cannot_cancel_a_members_job(
    client: Client, alice: User, bob: User
) -> None:
    lead(bob, "vision")
    job = JobFactory(owner=alice)
    client.force_login(bob)

    page = client.get(f"/jobs/{job.pk}/").content.decode()
    response = client.post(f"/jobs/{job.pk}/cancel/", follow=True)

    job.refresh_from_db()
    assert f'action="/jobs/{job.pk}/cancel/"' not in page
    assert job.status == Job.Status.PENDING and job.cancel_requested_at is None
    assert "cannot be cancelled" in response.content.decode()
