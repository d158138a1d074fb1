"""Webhook security: a URL may not lead into the portal's own network (checked at
save with the reason named, and again at each send against the address actually
connected to, Host kept), and the shared secret is encrypted at rest; a key
change asks its owner to set it again, never sends unsigned, never crashes, and
no secret reaches the logs."""

from __future__ import annotations

import importlib
import logging
from ipaddress import ip_address, ip_network
from typing import TYPE_CHECKING, Any

import pytest
from django.apps import apps as django_apps
from django.db import connection

from portal.notifications import secrets, services, signing, targets
from portal.notifications.models import Delivery, Kind, Preference
from tests.notifications.test_deliveries import SECRET, webhook_only

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

    from tests.notifications.conftest import Receiver

pytestmark = pytest.mark.django_db


@pytest.fixture
def nothing_allowed(settings: Any) -> None:
    settings.GPULAB_WEBHOOK_ALLOWED_NETWORKS = ()


def save(client: Client, url: str, secret: str = "a-long-enough-secret") -> Any:
    return client.post(
        "/notifications/",
        {"kinds": ["job_failed"], "webhook_url": url, "webhook_secret": secret},
    )


# ------------------------------------------------------------------ SSRF


@pytest.mark.usefixtures("nothing_allowed")
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:8000/hook", "127.0.0.1, a loopback address"),
        ("http://localhost/hook", "localhost resolves to"),
        ("http://10.1.2.3/hook", "10.1.2.3, a private address"),
        ("http://192.168.0.10/", "192.168.0.10, a private address"),
        ("http://169.254.169.254/latest/meta-data/", "a link-local address"),
        ("http://[::1]:9000/", "::1, a loopback address"),
        ("http://[::ffff:10.0.0.1]/", "a private address"),
        ("http://[fe80::1]/", "fe80::1, a link-local address"),
        ("http://224.0.0.1/", "224.0.0.1, a multicast address"),
        ("http://240.0.0.1/", "240.0.0.1, a reserved address"),
        ("http://0.0.0.0/", "0.0.0.0, an unspecified address"),
        ("http://100.64.0.1/", "100.64.0.1, a non-public address"),
    ],
)
def test_a_webhook_into_the_portals_network_is_refused_at_save(
    client: Client, alice: User, url: str, says: str
) -> None:
    Preference.objects.create(user=alice, kinds=["job_ended"])
    client.force_login(alice)

    resp = save(client, url)

    body = resp.content.decode()
    assert resp.status_code == 400
    assert says in body
    assert "webhooks may not reach the portal&#x27;s own network" in body
    assert "GPULAB_WEBHOOK_ALLOWED_NETWORKS" in body
    pref = Preference.objects.get(user=alice)  # nothing stored, nothing lost
    assert pref.webhook_url == "" and pref.kinds == ["job_ended"]


@pytest.mark.usefixtures("nothing_allowed")
def test_a_host_that_does_not_resolve_is_refused(client: Client, alice: User) -> None:
    client.force_login(alice)

    resp = save(client, "https://no-such-host.invalid/hook")

    assert resp.status_code == 400
    assert "no-such-host.invalid cannot be resolved" in resp.content.decode()


def test_an_allowed_network_and_public_addresses_may_be_used(
    client: Client, alice: User, settings: Any
) -> None:
    settings.GPULAB_WEBHOOK_ALLOWED_NETWORKS = (ip_network("10.20.0.0/16"),)
    client.force_login(alice)

    assert save(client, "http://10.20.3.4:8080/hook").status_code == 302
    assert save(client, "https://8.8.8.8/hook").status_code == 302
    assert save(client, "http://10.21.0.1/hook").status_code == 400  # outside it


def test_the_admin_form_checks_the_url_too(admin_user: User, alice: User) -> None:
    from django.test import Client as DjangoClient

    admin_user.is_superuser = True
    admin_user.save()
    pref = Preference.objects.create(user=alice)
    client = DjangoClient()
    client.force_login(admin_user)

    resp = client.post(
        f"/admin/notifications/preference/{pref.pk}/change/",
        {"user": alice.pk, "kinds": '["job_failed"]', "email_enabled": "on",
         "webhook_url": "http://169.254.169.254/", "updated_at_0": "2026-01-01",
         "updated_at_1": "00:00:00"},
    )  # fmt: skip

    assert resp.status_code == 200  # the form again, with the error
    assert "a link-local address" in resp.content.decode()
    pref.refresh_from_db()
    assert pref.webhook_url == ""


def test_the_address_is_checked_again_at_send_time(
    alice: User, receiver: Receiver, settings: Any
) -> None:
    """Saved while its network was allowed; no longer allowed when sent (or its
    name resolving elsewhere now): refused before any connection."""
    webhook_only(alice, receiver.url)
    [row] = services.notify(alice, Kind.TEST, "t", "t")
    settings.GPULAB_WEBHOOK_ALLOWED_NETWORKS = ()

    result = services.send(row.pk)

    assert result is not None and result.status == Delivery.Status.PENDING
    row.refresh_from_db()
    assert "not sent: 127.0.0.1, a loopback address" in row.last_error
    assert receiver.requests == []


def test_the_request_goes_to_a_checked_address_with_the_host_kept(
    alice: User, receiver: Receiver
) -> None:
    """``localhost`` is resolved once; the POST goes to one of its (allowed)
    addresses, the next if one refuses the connection (the receiver listens on
    127.0.0.1 only), with ``Host: localhost:PORT``."""
    port = receiver.url.split(":")[2].split("/")[0]
    webhook_only(alice, f"http://localhost:{port}/hook")
    [row] = services.notify(alice, Kind.TEST, "t", "t")

    result = services.send(row.pk)

    assert result is not None and result.status == Delivery.Status.SENT
    [got] = receiver.requests
    assert got.headers["Host"] == f"localhost:{port}"
    assert got.path == "/hook"


def test_a_pinned_request_keeps_the_name_for_host_and_tls() -> None:
    https = targets.pinned("https://hooks.lab.example/a?b=1", ip_address("8.8.4.4"))
    assert https == targets.Pinned(
        "https://8.8.4.4:443/a?b=1", "hooks.lab.example", "hooks.lab.example"
    )
    v6 = targets.pinned("http://hooks.lab.example:8080", ip_address("2001:db8::5"))
    assert v6 == targets.Pinned(
        "http://[2001:db8::5]:8080/", "hooks.lab.example:8080", None
    )


# ------------------------------------------------------------------ secrets


def test_the_secret_is_stored_encrypted_and_signs_as_before(
    alice: User, receiver: Receiver
) -> None:
    webhook_only(alice, receiver.url)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT webhook_secret FROM notifications_preference WHERE user_id = %s",
            [alice.pk],
        )
        [stored] = cursor.fetchone()
    assert stored.startswith("fernet:") and SECRET not in stored
    [row] = services.notify(alice, Kind.TEST, "t", "t")

    services.send(row.pk)

    [got] = receiver.requests
    assert signing.verify(
        SECRET,
        got.headers[signing.TIMESTAMP_HEADER],
        got.headers[signing.SIGNATURE_HEADER],
        got.body,
    )


def test_a_rotated_key_still_reads_the_secrets_of_the_old_one(
    alice: User, settings: Any
) -> None:
    settings.GPULAB_WEBHOOK_SECRET_KEY = ["the-old-key-of-the-portal"]
    pref = webhook_only(alice, "https://8.8.8.8/hook")
    settings.GPULAB_WEBHOOK_SECRET_KEY = [
        "the-new-key-of-the-portal",
        "the-old-key-of-the-portal",
    ]
    pref.refresh_from_db()
    assert pref.read_webhook_secret() == SECRET
    assert pref.secret_state == "set"


def test_after_a_key_change_the_owner_is_asked_again_and_nothing_is_sent_unsigned(
    client: Client, alice: User, receiver: Receiver, settings: Any, caplog: Any
) -> None:
    webhook_only(alice, receiver.url)
    settings.GPULAB_WEBHOOK_SECRET_KEY = ["a-brand-new-key-nobody-had"]
    [row] = services.notify(alice, Kind.TEST, "t", "t")

    with caplog.at_level(logging.DEBUG):
        result = services.send(row.pk)

    assert result is not None and result.status == Delivery.Status.PENDING
    assert receiver.requests == []  # never unsigned
    row.refresh_from_db()
    assert "secret can no longer be read" in row.last_error
    client.force_login(alice)
    page = client.get("/notifications/")
    assert page.status_code == 200
    assert 'data-testid="secret-unreadable"' in page.content.decode()
    # saving without a secret is refused with the reason; with one, it works
    resp = client.post(
        "/notifications/", {"kinds": ["job_failed"], "webhook_url": receiver.url}
    )
    assert resp.status_code == 400
    assert "can no longer be read" in resp.content.decode()
    assert save(client, receiver.url, "a-fresh-secret-1234").status_code == 302
    assert Preference.objects.get(user=alice).read_webhook_secret() == (
        "a-fresh-secret-1234"
    )
    assert SECRET not in caplog.text


def test_no_secret_reaches_the_logs(
    client: Client, alice: User, receiver: Receiver, caplog: Any
) -> None:
    receiver.statuses = [500]
    client.force_login(alice)
    with caplog.at_level(logging.DEBUG):
        assert save(client, receiver.url, "log-me-never-1234").status_code == 302
        [row] = services.notify(alice, Kind.TEST, "t", "t")
        services.send(row.pk)

    assert receiver.requests  # it was sent (and failed)
    assert "log-me-never-1234" not in caplog.text


def test_the_migration_encrypts_plain_secrets_once(alice: User, bob: User) -> None:
    Preference.objects.create(
        user=alice, webhook_url="https://8.8.8.8/", webhook_secret=SECRET
    )
    done = Preference(user=bob, webhook_url="https://8.8.8.8/")
    done.set_webhook_secret("bobs-secret-0123456")
    done.save()
    migration = importlib.import_module(
        "portal.notifications.migrations.0002_encrypted_webhook_secrets"
    )

    migration.encrypt_stored(django_apps, None)
    once = dict(Preference.objects.values_list("user_id", "webhook_secret"))
    migration.encrypt_stored(django_apps, None)

    assert dict(Preference.objects.values_list("user_id", "webhook_secret")) == once
    assert secrets.decrypt(once[alice.pk]) == SECRET
    assert secrets.decrypt(once[bob.pk]) == "bobs-secret-0123456"
