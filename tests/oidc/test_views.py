"""The sign-in views in the portal's own process: the button only when configured,
and every way the provider can fail (unreachable, not a discovery document, an error
answer, a forged or stale callback, its token endpoint gone mid-sign-in) ends on the
login page with a message naming the server, in the log too; never a 500, and a
local password still signs in."""

from __future__ import annotations

import http.server
import logging
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import pytest

from portal.oidc import discovery
from tests.e2e.conftest import free_port
from tests.oidc.conftest import CLIENT_ID, CLIENT_SECRET

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User
    from django.test import Client
    from pytest_django.fixtures import SettingsWrapper

    from tests.oidc.conftest import Provider

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_cached_discovery() -> Iterator[None]:
    discovery.forget()
    yield
    discovery.forget()


def configure(settings: SettingsWrapper, url: str) -> None:
    settings.GPULAB_OIDC_ENABLED = True
    settings.GPULAB_OIDC_DISCOVERY_URL = url
    settings.GPULAB_OIDC_BUTTON_LABEL = "Sign in with Keycloak"
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_TIMEOUT = 5.0
    settings.OIDC_RP_SCOPES = "openid email profile lab"


def messages_on_login_page(client: Client, response: Any) -> str:
    assert response.status_code == 302, response
    assert response["Location"] == "/accounts/login/"
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    return str(page.content.decode())


def test_no_button_and_no_sign_in_views_when_not_configured(client: Client) -> None:
    page = client.get("/accounts/login/").content.decode()
    assert "oidc-sign-in" not in page
    assert client.get("/oidc/authenticate/").status_code == 404
    assert client.get("/oidc/callback/?code=x&state=y").status_code == 404


def test_the_button_shows_the_configured_label(
    client: Client, settings: SettingsWrapper
) -> None:
    configure(settings, "https://sso.example.org/realms/lab")
    page = client.get("/accounts/login/?next=/jobs/").content.decode()
    assert ">Sign in with Keycloak</a>" in page
    assert 'href="/oidc/authenticate/?next=/jobs/"' in page


def test_an_unreachable_provider_is_named_and_a_local_password_still_works(
    client: Client,
    settings: SettingsWrapper,
    alice: User,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://127.0.0.1:{free_port()}/realms/lab"  # nothing listens there
    configure(settings, url)
    with caplog.at_level(logging.ERROR, logger="portal.oidc"):
        response = client.get("/oidc/authenticate/")
    page = messages_on_login_page(client, response)
    wanted = f"The identity provider cannot be reached at {url}/.well-known/openid"
    assert wanted in page
    assert "sign in with a local account" in page
    assert any(wanted in r.getMessage() for r in caplog.records)

    response = client.post(
        "/accounts/login/", {"username": "alice", "password": "pw-alice"}
    )
    assert response.status_code == 302
    assert response["Location"] == "/"
    assert client.get("/").status_code == 200


class _Answers(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[Any]:
    """A real HTTP server on loopback answering every GET with a set body."""

    class Handler(_Answers):
        pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, Handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (503, b"{}", "answered HTTP 503"),
        (200, b"<html>maintenance</html>", "is not JSON"),
        (200, b"[1]", "is not a JSON object"),
        (
            200,
            b'{"issuer": "x", "authorization_endpoint": "https://a/", '
            b'"token_endpoint": 5, "end_session_endpoint": "nope"}',
            "lacks a usable token_endpoint, userinfo_endpoint, jwks_uri,"
            " end_session_endpoint",
        ),
    ],
)
def test_a_malformed_discovery_document_is_named(
    client: Client,
    settings: SettingsWrapper,
    answering: Any,
    status: int,
    body: bytes,
    says: str,
) -> None:
    server, handler = answering
    handler.status, handler.body = status, body
    url = f"http://127.0.0.1:{server.server_port}/.well-known/openid-configuration"
    configure(settings, url)
    page = messages_on_login_page(client, client.get("/oidc/authenticate/"))
    assert url in page
    assert says in page


def test_a_provider_error_or_a_stale_callback_ends_on_the_login_page(
    client: Client, settings: SettingsWrapper
) -> None:
    configure(settings, "https://sso.example.org/realms/lab")
    page = messages_on_login_page(
        client,
        client.get(
            "/oidc/callback/?error=access_denied&error_description=Not+in+the+lab"
        ),
    )
    assert "The identity provider refused the sign-in: Not in the lab" in page
    # A code with no sign-in begun in this browser.
    page = messages_on_login_page(client, client.get("/oidc/callback/?code=c&state=s"))
    assert "The sign-in did not complete" in page
    # A state this browser never got (forged, or replayed): refused, not a 400.
    session = client.session
    session["oidc_states"] = {"mine": {"nonce": "n", "code_verifier": None}}
    session.save()
    page = messages_on_login_page(
        client, client.get("/oidc/callback/?code=c&state=forged")
    )
    assert "The sign-in could not be verified" in page


def test_the_provider_gone_between_the_button_and_the_callback(
    client: Client,
    settings: SettingsWrapper,
    provider: Provider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The button reads discovery from a live provider; it stops before the
    browser comes back with a code: the token endpoint is named."""
    port = free_port()
    second = provider.serve(port)
    configure(settings, f"http://127.0.0.1:{port}/openid")
    response = client.get("/oidc/authenticate/")
    assert response.status_code == 302
    target = urlsplit(response["Location"])
    assert f"{target.scheme}://{target.netloc}{target.path}" == (
        f"http://127.0.0.1:{port}/openid/authorize"
    )
    query = parse_qs(target.query)
    assert query["client_id"] == [CLIENT_ID]
    assert query["code_challenge_method"] == ["S256"]
    state = query["state"][0]

    second.stop()
    with caplog.at_level(logging.ERROR, logger="portal.oidc"):
        response = client.get(f"/oidc/callback/?code=anything&state={state}")
    page = messages_on_login_page(client, response)
    token_endpoint = f"http://127.0.0.1:{port}/openid/token"
    assert f"The identity provider at {token_endpoint} did not answer" in page
    assert any(token_endpoint in r.getMessage() for r in caplog.records)


def test_signed_out_sends_to_the_provider_only_after_a_sign_out(
    client: Client, settings: SettingsWrapper, alice: User, answering: Any
) -> None:
    """The page after a sign-out: with the ID token's cookie, to the provider's
    end_session_endpoint; followed while still signed in, nowhere."""
    from portal.oidc.views import _SALT, ID_TOKEN_COOKIE

    server, handler = answering
    base = f"http://127.0.0.1:{server.server_port}"
    handler.body = (
        f'{{"issuer": "{base}", "authorization_endpoint": "{base}/auth",'
        f' "token_endpoint": "{base}/token", "userinfo_endpoint": "{base}/me",'
        f' "jwks_uri": "{base}/keys", "end_session_endpoint": "{base}/logout"}}'
    ).encode()
    configure(settings, base)
    signed = client.get("/accounts/login/")  # any response to sign a cookie on
    signed.set_signed_cookie(ID_TOKEN_COOKIE, "the.id.token", salt=_SALT)
    client.cookies[ID_TOKEN_COOKIE] = signed.cookies[ID_TOKEN_COOKIE].value

    client.force_login(alice)
    response = client.get("/oidc/signed-out/")
    assert response.status_code == 302
    assert response["Location"] == "/"
    assert client.get("/").status_code == 200  # still signed in

    # Django's sign-out lands there (LOGOUT_REDIRECT_URL).
    response = client.post("/accounts/logout/")
    assert response["Location"] == "/oidc/signed-out/"
    response = client.get("/oidc/signed-out/")
    target = urlsplit(response["Location"])
    assert f"{target.scheme}://{target.netloc}{target.path}" == f"{base}/logout"
    assert parse_qs(target.query) == {
        "id_token_hint": ["the.id.token"],
        "post_logout_redirect_uri": ["http://testserver/accounts/login/"],
    }
    assert response.cookies[ID_TOKEN_COOKIE].value == ""  # deleted

    # A local user's sign-out: straight to the login page.
    client.force_login(alice)
    client.post("/accounts/logout/")
    response = client.get("/oidc/signed-out/")
    assert response["Location"] == "/accounts/login/"


def test_the_login_page_offers_what_is_configured(
    client: Client, settings: SettingsWrapper
) -> None:
    """OIDC alone with local sign-in off: the button only; beside LDAP: the button
    and the directory's password form."""
    configure(settings, "https://sso.example.org/realms/lab")
    settings.GPULAB_LDAP_URI = ""
    settings.GPULAB_LOCAL_LOGIN = "off"
    page = client.get("/accounts/login/").content.decode()
    assert "Sign in with Keycloak" in page
    assert 'name="password"' not in page

    settings.GPULAB_LDAP_URI = "ldap://127.0.0.1:1"
    page = client.get("/accounts/login/").content.decode()
    assert "Sign in with Keycloak" in page
    assert 'name="password"' in page
    assert "(your lab directory account)" in page
