"""Personal tokens (stored hashed, shown once, revoked, expired) and the
Redis-backed rate limit per token."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client
from django.utils import timezone

from portal.api import throttling, tokens
from portal.api.models import ApiToken
from tests.api.conftest import Api

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


def test_a_token_is_shown_once_and_stored_hashed(alice: User) -> None:
    web = Client()
    web.force_login(alice)
    page = web.post("/tokens/", {"name": "laptop", "days": "30"})
    assert page.status_code == 200
    assert page["Cache-Control"] == "no-store"
    secret = page.context["secret"]
    assert secret.startswith("gpl_") and secret in page.content.decode()
    row = ApiToken.objects.get(user=alice)
    assert row.token_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in str(ApiToken.objects.values().get())
    assert row.expires_at is not None
    assert secret not in web.get("/tokens/").content.decode()
    me = Api(secret).get("/api/v1/me/")
    assert me.json()["username"] == "alice"
    row.refresh_from_db()
    assert row.last_used_at is not None


def test_a_bad_token_form_is_refused(alice: User) -> None:
    web = Client()
    web.force_login(alice)
    page = web.post("/tokens/", {"name": "", "days": "-1"})
    assert page.status_code == 400
    assert not ApiToken.objects.exists()


def test_a_revoked_or_expired_token_stops_at_once(alice: User, bob: User) -> None:
    token, secret = tokens.create_token(alice, "ci", None)
    assert Api(secret).get("/api/v1/me/").status_code == 200
    web = Client()
    web.force_login(bob)  # not bob's token: nothing happens
    web.post(f"/tokens/{token.pk}/revoke/")
    assert Api(secret).get("/api/v1/me/").status_code == 200
    web.force_login(alice)
    web.post(f"/tokens/{token.pk}/revoke/")
    got = Api(secret).get("/api/v1/me/")
    assert (got.status_code, got.json()["error"]) == (401, "authentication_failed")
    assert tokens.revoke_token(alice, token.pk) is False
    old, old_secret = tokens.create_token(alice, "old", 1)
    ApiToken.objects.filter(pk=old.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert Api(old_secret).get("/api/v1/me/").status_code == 401


def test_the_session_works_with_csrf(alice: User, cluster: Any) -> None:
    web = Client(enforce_csrf_checks=True)
    web.force_login(alice)
    assert web.get("/api/v1/me/").json()["token"] is None
    got = web.post("/api/v1/jobs/", {}, content_type="application/json")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    assert "CSRF" in got.json()["detail"]


def test_the_rate_limit_is_per_token_with_retry_after(
    alice: User, settings: Any
) -> None:
    settings.GPULAB_API_RATE_LIMIT = 3
    settings.GPULAB_API_RATE_WINDOW = 60
    first, second = (
        Api(tokens.create_token(alice, "a", None)[1]),
        Api(tokens.create_token(alice, "b", None)[1]),
    )
    for _ in range(3):
        assert first.get("/api/v1/me/").status_code == 200
    got = first.get("/api/v1/me/")
    assert (got.status_code, got.json()["error"]) == (429, "throttled")
    assert 1 <= int(got["Retry-After"]) <= 20
    assert second.get("/api/v1/me/").status_code == 200  # its own budget


def test_the_limiter_refills_at_the_rate() -> None:
    ident = f"test:{timezone.now().timestamp()}"
    assert throttling.hit(ident, 2, 3600) == 0
    assert throttling.hit(ident, 2, 3600) == 0
    wait = throttling.hit(ident, 2, 3600)
    assert 1700 < wait <= 1800  # one request per 1800 s after the burst
