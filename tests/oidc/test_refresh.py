"""The periodic refresh (``portal.oidc.refresh``) against a provider that fails in
each way a real one can: unreachable, its token endpoint down or answering an
error, a refresh token it refuses. Only a refused token deactivates; every outage
leaves everyone as they were, with a warning naming the URL. A user another run is
refreshing (row locked) is skipped, the provider not asked.

The provider here is a real HTTP server on loopback answering what each test sets;
the whole flow against a real provider is ``test_refresh_provider.py``."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
from django.contrib.auth.models import User
from django.db import connections, transaction
from django.utils import timezone

from portal.api.models import ApiToken
from portal.api.tokens import create_token
from portal.oidc import discovery, secrets
from portal.oidc.models import OidcIdentity
from portal.oidc.refresh import refresh_oidc_users
from portal.quotas.models import AuditEntry
from scheduler.models import Profile
from tests.e2e.conftest import free_port
from tests.oidc.test_views import configure

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pytest_django.fixtures import SettingsWrapper

ISSUER = "https://sso.example.org/realms/lab"


class _Provider(http.server.BaseHTTPRequestHandler):
    """Discovery on GET; the token endpoint answers ``token`` (status, body)."""

    token: ClassVar[tuple[int, bytes]] = (503, b"{}")
    token_url = ""
    posts: ClassVar[list[dict[str, list[str]]]] = []

    def do_GET(self) -> None:
        base = f"http://127.0.0.1:{self.server.server_port}"  # type: ignore[attr-defined]
        document = {
            "issuer": ISSUER,
            "authorization_endpoint": f"{base}/authorize",
            "token_endpoint": self.token_url or f"{base}/token",
            "userinfo_endpoint": f"{base}/userinfo",
            "jwks_uri": f"{base}/jwks",
        }
        self._answer(200, json.dumps(document).encode())

    def do_POST(self) -> None:
        from urllib.parse import parse_qs

        length = int(self.headers.get("Content-Length", 0))
        type(self).posts.append(parse_qs(self.rfile.read(length).decode()))
        self._answer(*self.token)

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def idp(settings: SettingsWrapper) -> Iterator[type[_Provider]]:
    class Handler(_Provider):
        posts: ClassVar[list[dict[str, list[str]]]] = []

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    configure(settings, f"http://127.0.0.1:{server.server_address[1]}")
    discovery.forget()
    try:
        yield Handler
    finally:
        discovery.forget()
        server.shutdown()
        server.server_close()


def oidc_user(name: str = "fay", token: str = "rt-fay-0") -> User:
    user = User.objects.create_user(name)
    Profile.objects.create(user=user, directory=Profile.Directory.OIDC)
    OidcIdentity.objects.create(
        user=user,
        issuer=ISSUER,
        sub=f"sub-{name}",
        refresh_token=secrets.encrypt(token),
        signed_in_at=timezone.now(),
    )
    return user


def state(user: User) -> dict[str, Any]:
    user.refresh_from_db()
    link = OidcIdentity.objects.get(user=user)
    return {
        "active": user.is_active,
        "token": secrets.decrypt(link.refresh_token),
        "api_tokens_live": ApiToken.objects.filter(
            user=user, revoked_at__isnull=True
        ).count(),
    }


pytestmark = pytest.mark.django_db


def test_an_unreachable_provider_deactivates_nobody_and_is_named(
    settings: SettingsWrapper, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"http://127.0.0.1:{free_port()}/realms/lab"
    configure(settings, url)
    discovery.forget()
    fay = oidc_user()
    create_token(fay, "laptop", 30)
    with caplog.at_level(logging.WARNING, logger="portal.oidc.refresh"):
        counts = refresh_oidc_users()
    assert counts["checked"] == counts["deactivated"] == 0
    assert f"cannot be reached at {url}/.well-known/openid-configuration" in caplog.text
    assert state(fay) == {"active": True, "token": "rt-fay-0", "api_tokens_live": 1}


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ("down", "cannot be reached"),
        ((503, b"<html>maintenance</html>"), "answered HTTP 503 with no JSON"),
        ((500, b'{"error": "server_error"}'), "answered HTTP 500 server_error"),
        ((401, b'{"error": "invalid_client"}'), "answered HTTP 401 invalid_client"),
        ((200, b'{"token_type": "bearer"}'), "answered without an access_token"),
    ],
)
def test_a_failing_token_endpoint_stops_the_run_and_deactivates_nobody(
    idp: type[_Provider],
    caplog: pytest.LogCaptureFixture,
    answer: Any,
    says: str,
) -> None:
    if answer == "down":
        idp.token_url = f"http://127.0.0.1:{free_port()}/token"
        url = idp.token_url
    else:
        idp.token = answer
        url = "/token"
    fay, gus = oidc_user("fay"), oidc_user("gus", "rt-gus-0")
    with caplog.at_level(logging.WARNING, logger="portal.oidc.refresh"):
        counts = refresh_oidc_users()
    assert counts == {
        "checked": 0, "changed": 0, "deactivated": 0, "busy": 0, "failed": 0,
    }  # fmt: skip
    # One try, then the run stops: the next one tries everyone again.
    assert len(idp.posts) == (0 if answer == "down" else 1)
    assert "nobody deactivated" in caplog.text
    assert url in caplog.text and says in caplog.text
    assert state(fay)["active"] and state(gus)["active"]
    assert state(fay)["token"] == "rt-fay-0"


def test_a_refused_refresh_token_deactivates_that_user_only(
    idp: type[_Provider], client: Any
) -> None:
    idp.token = (400, b'{"error": "invalid_grant"}')
    fay = oidc_user("fay")
    create_token(fay, "laptop", 30)
    client.force_login(fay)
    counts = refresh_oidc_users()
    assert counts["deactivated"] == 1
    assert idp.posts[0]["grant_type"] == ["refresh_token"]
    assert idp.posts[0]["refresh_token"] == ["rt-fay-0"]
    assert idp.posts[0]["client_id"] == ["gpulab-portal"]
    assert state(fay) == {"active": False, "token": "", "api_tokens_live": 0}
    assert client.get("/").status_code == 302  # the session is gone
    entry = AuditEntry.objects.filter(object_id=str(fay.pk)).latest("pk")
    assert entry.via == "oidc"
    assert "refused the refresh token: invalid_grant" in entry.new["reason"]
    assert OidcIdentity.objects.get(user=fay).refresh_error.endswith(
        "/token: invalid_grant"
    )
    # Not asked again: no token to use until she signs in.
    assert refresh_oidc_users()["checked"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_user_another_run_is_refreshing_is_skipped(idp: type[_Provider]) -> None:
    idp.token = (400, b'{"error": "invalid_grant"}')
    fay = oidc_user("fay")
    locked, release = threading.Event(), threading.Event()

    def other_run() -> None:
        try:
            with transaction.atomic():
                OidcIdentity.objects.select_for_update().get(user=fay)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=other_run)
    thread.start()
    try:
        assert locked.wait(30)
        counts = refresh_oidc_users()
    finally:
        release.set()
        thread.join(30)
    assert counts["busy"] == 1 and counts["checked"] == 0
    assert idp.posts == []  # the token was not spent a second time
    assert state(fay)["active"] is True


def test_an_account_that_signed_in_through_ldap_since_is_left_to_ldap(
    idp: type[_Provider],
) -> None:
    idp.token = (400, b'{"error": "invalid_grant"}')
    fay = oidc_user("fay")
    Profile.objects.filter(user=fay).update(directory=Profile.Directory.LDAP)
    assert refresh_oidc_users()["checked"] == 0
    assert idp.posts == []
    assert state(fay)["active"] is True


def test_an_unusable_answer_keeps_the_new_token_and_the_user(
    idp: type[_Provider], caplog: pytest.LogCaptureFixture
) -> None:
    # A rotated refresh token with an ID token that is not a JWT: the user is
    # left as they are, the new token kept (the provider spent the old one).
    idp.token = (
        200,
        b'{"access_token": "at", "refresh_token": "rt-fay-1", "id_token": "x.y.z"}',
    )
    fay = oidc_user("fay")
    with caplog.at_level(logging.ERROR, logger="portal.oidc.refresh"):
        assert refresh_oidc_users()["failed"] == 1
    assert "fay left as they are" in caplog.text
    assert state(fay) == {"active": True, "token": "rt-fay-1", "api_tokens_live": 0}
    assert OidcIdentity.objects.get(user=fay).refresh_error
