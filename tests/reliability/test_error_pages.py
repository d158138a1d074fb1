"""A request that finds the database unreachable gets a 503 saying so (a page, or
JSON for API clients), with Retry-After, never a traceback; any other crash is
still Django's plain 500. (tests/reliability/test_restarts.py stops a real
PostgreSQL under a real server.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest
from django.db import InterfaceError, OperationalError
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


def get_jobs(user: User, error: Exception, **headers: Any) -> Any:
    client = Client(raise_request_exception=False)
    client.force_login(user)
    with mock.patch(
        "portal.views.jobs.Job.objects.visible_to", autospec=True, side_effect=error
    ):
        return client.get(reverse("portal-jobs"), **headers)


@pytest.mark.parametrize(
    "error",
    [OperationalError("connection refused"), InterfaceError("connection closed")],
    ids=["operational", "interface"],
)
def test_an_unreachable_database_is_a_503_page(alice: User, error: Exception) -> None:
    response = get_jobs(alice, error)

    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    body = response.content.decode()
    assert "The database is unavailable; nothing was changed." in body
    assert "Traceback" not in body and "connection refused" not in body


def test_an_api_client_gets_json(alice: User) -> None:
    response = get_jobs(alice, OperationalError("down"), HTTP_ACCEPT="application/json")

    assert response.status_code == 503
    assert response.json() == {
        "error": "unavailable",
        "detail": "The database is unavailable; nothing was changed. Try again shortly.",
        "fields": {},
    }


def test_the_api_says_503_in_its_error_body(alice: User) -> None:
    client = APIClient()
    client.force_authenticate(alice)
    with mock.patch(
        "portal.api.views.jobs.jobs_for", side_effect=OperationalError("down")
    ):
        response = client.get("/api/v1/jobs/")

    assert (response.status_code, response["Retry-After"]) == (503, "5")
    assert response.json()["error"] == "unavailable"


def test_any_other_crash_is_still_a_plain_500(alice: User) -> None:
    response = get_jobs(alice, RuntimeError("a bug"))

    assert response.status_code == 500
    assert "a bug" not in response.content.decode()
