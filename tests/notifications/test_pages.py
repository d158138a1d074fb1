"""The notifications page (preferences, test button, deliveries), the job page's
idle flag and the admin job list's idle filter."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from portal.idle.models import IdleFlag
from portal.notifications.models import Delivery, Kind, Preference
from tests.conftest import make_node
from tests.factories import JobFactory, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client


def test_the_page_is_linked_from_the_navigation(client: Client, alice: User) -> None:
    client.force_login(alice)
    page = client.get("/jobs/")
    assert 'href="/notifications/"' in page.content.decode()
    assert client.get("/notifications/").status_code == 200


def test_saving_preferences(client: Client, alice: User) -> None:
    client.force_login(alice)
    resp = client.post(
        "/notifications/",
        {
            "kinds": ["job_started", "idle_warning"],
            "email_enabled": "",
            "webhook_url": "https://localhost/gpulab",
            "webhook_secret": "a-long-enough-secret",
        },
    )
    assert resp.status_code == 302
    pref = Preference.objects.get(user=alice)
    assert pref.kinds == ["job_started", "idle_warning"]
    assert not pref.email_enabled
    assert pref.read_webhook_secret() == "a-long-enough-secret"
    assert "a-long-enough-secret" not in pref.webhook_secret  # encrypted at rest
    # Saving again without typing the secret keeps it; it is never shown.
    page = client.get("/notifications/").content.decode()
    assert "a-long-enough-secret" not in page and "a secret is set" in page
    client.post(
        "/notifications/",
        {"kinds": ["job_failed"], "webhook_url": "https://localhost/gpulab"},
    )
    pref.refresh_from_db()
    assert pref.kinds == ["job_failed"]
    assert pref.read_webhook_secret() == "a-long-enough-secret"


def test_bad_input_is_named_and_loses_nothing(client: Client, alice: User) -> None:
    Preference.objects.create(user=alice, kinds=["job_failed"])
    client.force_login(alice)
    cases = [
        ({"webhook_url": "ftp://x.example/"}, "Use an http:// or https:// address"),
        ({"webhook_url": "https://localhost/"}, "A webhook needs a secret"),
        (
            {"webhook_url": "https://localhost/", "webhook_secret": "short"},
            "at least 16 characters",
        ),
        ({"kinds": ["nonsense"]}, "Select a valid choice"),
    ]
    for data, error in cases:
        resp = client.post("/notifications/", data)
        assert resp.status_code == 400, data
        assert error in resp.content.decode(), data
    pref = Preference.objects.get(user=alice)
    assert pref.kinds == ["job_failed"] and pref.webhook_url == ""


def test_the_test_button_sends_by_every_channel_and_shows_the_outcome(
    client: Client, alice: User, django_capture_on_commit_callbacks: Any
) -> None:
    client.force_login(alice)
    with django_capture_on_commit_callbacks():
        resp = client.post("/notifications/test/", follow=True)
    assert "Test sent by email" in resp.content.decode()
    row = Delivery.objects.get(user=alice, kind=Kind.TEST)
    # A delivery that failed for good is shown with its error.
    row.status = Delivery.Status.FAILED
    row.last_error = "gave up after 6 attempts: HTTP 500 from the webhook"
    row.save()
    page = client.get("/notifications/").content.decode()
    assert "gave up after 6 attempts: HTTP 500 from the webhook" in page


def test_the_test_button_with_nothing_to_send(client: Client, alice: User) -> None:
    Preference.objects.create(user=alice, email_enabled=False)
    client.force_login(alice)
    resp = client.post("/notifications/test/", follow=True)
    assert "Nothing to send" in resp.content.decode()
    assert not Delivery.objects.exists()


def test_users_see_only_their_own_deliveries(
    client: Client, alice: User, bob: User
) -> None:
    Delivery.objects.create(
        user=bob, kind=Kind.TEST, channel="email", target="b@x", subject="bobs-secret",
        text="t",
    )  # fmt: skip
    client.force_login(alice)
    assert "bobs-secret" not in client.get("/notifications/").content.decode()


def idle_job(owner: User) -> Any:
    node, _ = make_node("n-page", 1)
    job = JobFactory(owner=owner)
    attempt = start_job(job, node)
    from scheduler import services

    services.mark_started(node.pk, started_data(attempt))
    now = timezone.now()
    IdleFlag.objects.create(
        job=job, attempt=attempt, since=now - timedelta(minutes=31), flagged_at=now,
        checked_at=now, threshold=5, window_s=1800, util_max=0.0, util_mean=0.0,
        memory_mib=20000, gpus=1, action="cancel",
        cancel_at=now + timedelta(minutes=30),
    )  # fmt: skip
    return job


def test_the_job_page_shows_the_idle_flag(client: Client, alice: User) -> None:
    job = idle_job(alice)
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-testid="idle-flag"' in page
    assert "at most 0.0 % SM" in page
    assert "It will be cancelled at" in page
    IdleFlag.objects.update(cleared_at=timezone.now(), cleared="active")
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-testid="idle-flag"' not in page


def test_the_admin_job_list_filters_idle_jobs(
    client: Client, alice: User, admin_user: User
) -> None:
    admin_user.is_superuser = True
    admin_user.save()
    idle = idle_job(alice)
    busy = JobFactory(owner=alice, name="busy-one")
    client.force_login(admin_user)
    page = client.get("/admin/scheduler/job/?idle=now").content.decode()
    assert f"/admin/scheduler/job/{idle.pk}/change/" in page
    assert f"/admin/scheduler/job/{busy.pk}/change/" not in page
    assert "idle GPUs" in client.get("/admin/scheduler/job/").content.decode()
