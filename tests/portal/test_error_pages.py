"""The product's own error pages (DEBUG off, as ``make up`` and production run):
a job someone may not see is a 404 in the site's style that lists nothing of the
site's URLs; a refusal is a 403 page saying why; a crash a plain 500 page. The
site's static files are served with DEBUG off too (WhiteNoise)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.test import Client, RequestFactory, override_settings

from portal.views.errors import server_error
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@override_settings(DEBUG=False)
def test_another_users_job_is_the_sites_own_404(alice: User, charlie: User) -> None:
    job = JobFactory(owner=alice)

    response = signed_in(charlie).get(f"/jobs/{job.pk}/")

    assert response.status_code == 404
    html = response.content.decode()
    assert "<h1>Not found</h1>" in html
    assert 'class="topbar"' in html  # the site's page, with its navigation
    assert 'href="/jobs/"' in html
    assert "URLconf" not in html
    assert "portal-job" not in html  # no URL pattern names


@override_settings(DEBUG=False)
def test_a_refusal_is_the_sites_own_403_saying_why(alice: User) -> None:
    response = signed_in(alice).get("/admin/")

    assert response.status_code == 403
    html = response.content.decode()
    assert "<h1>Not allowed</h1>" in html
    assert "staff" in html  # the reason the site gave
    assert 'class="topbar"' in html


@override_settings(DEBUG=False)
def test_a_crash_is_a_plain_500_page_in_the_sites_style() -> None:
    response = server_error(RequestFactory().get("/jobs/"))

    assert response.status_code == 500
    html = response.content.decode()
    assert "<h1>Something went wrong</h1>" in html
    assert 'href="/static/portal/css/portal.css"' in html


@override_settings(DEBUG=False)
def test_static_files_are_served_with_debug_off() -> None:
    response = Client().get("/static/portal/css/portal.css")

    assert response.status_code == 200
    assert b".topbar" in b"".join(response.streaming_content)  # type: ignore[attr-defined]
