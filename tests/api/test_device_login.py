"""``gpulab login`` through the browser (RFC 8628's device authorization grant):
the device code and token endpoints and the approval page, on the real test
database and Redis (the rate limits). Every state a poll can meet: pending,
slow_down, approved (a token, once), denied, expired, used twice, two polls at
once; the per-address limit on new codes, the per-user limit on code lookups,
wrong and malformed codes, bad machine names."""

from __future__ import annotations

import hashlib
import itertools
import re
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client
from django.utils import timezone

from portal.api import tokens
from portal.api.models import USER_CODE_ALPHABET, ApiToken, DeviceAuthorization
from tests.api.conftest import Api

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

CODE = "/api/v1/device/code/"
TOKEN = "/api/v1/device/token/"
PAGE = "/device/"
# Each test asks from its own addresses: the rate limit's Redis state lasts the run.
_addresses = (f"10.77.{n // 250}.{n % 250 + 1}" for n in itertools.count())


def new_address() -> str:
    return next(_addresses)


def ask_code(name: str = "lab-laptop", address: str | None = None) -> Any:
    return Client().post(
        CODE,
        {"client_name": name},
        content_type="application/json",
        REMOTE_ADDR=address or new_address(),
    )


def start(name: str = "lab-laptop") -> dict[str, Any]:
    got = ask_code(name)
    assert got.status_code == 200, got.content
    return dict(got.json())


def poll(device_code: str) -> Any:
    return Client().post(
        TOKEN, {"device_code": device_code}, content_type="application/json"
    )


def error_of(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["error"]


def row_of(started: dict[str, Any]) -> DeviceAuthorization:
    return DeviceAuthorization.objects.get(
        user_code=started["user_code"].replace("-", "")
    )


def waited(started: dict[str, Any]) -> None:
    """As if the CLI had waited its interval since its last poll."""
    row = row_of(started)
    if row.last_polled_at is not None:
        DeviceAuthorization.objects.filter(pk=row.pk).update(
            last_polled_at=row.last_polled_at - timedelta(seconds=row.interval)
        )


def signed_in(user: User) -> Client:
    """A browser's session, CSRF enforced as in production."""
    web = Client(enforce_csrf_checks=True)
    web.force_login(user)
    return web


def decide(web: Client, code: str, decision: str) -> Any:
    page = web.get(PAGE, {"code": code})
    assert page.status_code == 200, page.content
    return web.post(
        PAGE,
        {
            "code": code,
            "decision": decision,
            "csrfmiddlewaretoken": web.cookies["csrftoken"].value,
        },
    )


# ------------------------------------------------------------------ the whole way


def test_a_device_login_from_code_to_token(alice: User, settings: Any) -> None:
    settings.GPULAB_API_TOKEN_DAYS = 30
    address = new_address()
    got = ask_code("lab-laptop", address)
    assert got.status_code == 200
    assert got["Cache-Control"] == "no-store"
    started = got.json()
    assert re.fullmatch(
        f"[{USER_CODE_ALPHABET}]{{4}}-[{USER_CODE_ALPHABET}]{{4}}", started["user_code"]
    )
    assert started["verification_uri"] == "http://testserver/device/"
    assert started["verification_uri_complete"] == (
        f"http://testserver/device/?code={started['user_code']}"
    )
    assert (started["expires_in"], started["interval"]) == (600, 5)
    row = row_of(started)
    # only the device code's hash is kept
    assert (
        row.device_code_hash
        == hashlib.sha256(started["device_code"].encode()).hexdigest()
    )
    assert started["device_code"] not in str(DeviceAuthorization.objects.values().get())
    assert (row.client_name, row.client_address, row.status) == (
        "lab-laptop",
        address,
        "pending",
    )

    assert error_of(poll(started["device_code"])) == (400, "authorization_pending")

    # The page shows the machine, its address and the code; the typed code may be
    # lower case, without the dash, with spaces.
    web = signed_in(alice)
    typed = started["user_code"].lower().replace("-", " ")
    page = web.get(PAGE, {"code": typed})
    html = page.content.decode()
    assert page.status_code == 200
    assert "lab-laptop" in html and address in html and started["user_code"] in html
    approved = decide(web, typed, "approve")
    assert approved.status_code == 200
    assert "Approved" in approved.content.decode()
    row.refresh_from_db()
    assert (row.status, row.user) == ("approved", alice)

    waited(started)
    issued = poll(started["device_code"])
    assert issued.status_code == 200, issued.content
    assert issued["Cache-Control"] == "no-store"
    body = issued.json()
    assert (body["token_type"], body["token_name"], body["username"]) == (
        "Bearer",
        "lab-laptop",
        "alice",
    )
    assert body["expires_in"] == 30 * 86400
    me = Api(body["access_token"]).get("/api/v1/me/").json()
    assert (me["username"], me["token"]) == ("alice", "lab-laptop")
    token = ApiToken.objects.get(user=alice)
    assert token.token_hash == hashlib.sha256(body["access_token"].encode()).hexdigest()
    row.refresh_from_db()
    assert (row.status, row.token) == ("issued", token)

    # Listed on the Tokens page, with where it came from; revoked there, it stops.
    listing = web.get("/tokens/").content.decode()
    assert "lab-laptop" in listing and f"gpulab login from {address}" in listing
    assert tokens.revoke_token(alice, token.pk)
    assert Api(body["access_token"]).get("/api/v1/me/").status_code == 401

    # single use: the same device code never gives a second token
    waited(started)
    assert error_of(poll(started["device_code"])) == (400, "invalid_grant")
    assert ApiToken.objects.filter(user=alice).count() == 1


def test_the_page_asks_to_sign_in_first_and_comes_back(alice: User) -> None:
    started = start()
    got = Client().get(PAGE, {"code": started["user_code"]})
    assert got.status_code == 302
    assert got["Location"].startswith("/accounts/login/?next=/device/")
    assert started["user_code"] in got["Location"]
    assert row_of(started).status == "pending"


# ------------------------------------------------------------------ each state of a poll


def test_polling_faster_than_the_interval_slows_down(alice: User) -> None:
    started = start()
    code = started["device_code"]
    assert error_of(poll(code)) == (400, "authorization_pending")
    assert error_of(poll(code)) == (400, "slow_down")
    assert row_of(started).interval == 10
    assert error_of(poll(code)) == (400, "slow_down")
    assert row_of(started).interval == 15
    waited(started)
    assert error_of(poll(code)) == (400, "authorization_pending")
    assert row_of(started).interval == 15


def test_a_denied_login_gets_no_token(alice: User) -> None:
    started = start()
    web = signed_in(alice)
    denied = decide(web, started["user_code"], "deny")
    assert denied.status_code == 200 and "Denied" in denied.content.decode()
    waited(started)
    got = poll(started["device_code"])
    assert error_of(got) == (400, "access_denied")
    assert "denied" in got.json()["detail"]
    assert not ApiToken.objects.exists()
    # decided once: no approving it afterwards
    again = web.get(PAGE, {"code": started["user_code"]})
    assert again.status_code == 400
    assert "No sign-in waits with this code" in again.content.decode()
    assert row_of(started).status == "denied"


def test_an_expired_code_can_be_neither_approved_nor_redeemed(alice: User) -> None:
    started = start()
    DeviceAuthorization.objects.filter(pk=row_of(started).pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    web = signed_in(alice)
    page = web.get(PAGE, {"code": started["user_code"]})
    assert page.status_code == 400
    token = web.cookies["csrftoken"].value
    post = web.post(
        PAGE,
        {
            "code": started["user_code"],
            "decision": "approve",
            "csrfmiddlewaretoken": token,
        },
    )
    assert post.status_code == 400
    assert "No sign-in waits with this code" in post.content.decode()
    assert row_of(started).status == "pending"
    got = poll(started["device_code"])
    assert error_of(got) == (400, "expired_token")
    assert "gpulab login again" in got.json()["detail"]


def test_an_approved_code_expired_before_its_poll_gives_no_token(alice: User) -> None:
    started = start()
    decide(signed_in(alice), started["user_code"], "approve")
    DeviceAuthorization.objects.filter(pk=row_of(started).pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert error_of(poll(started["device_code"])) == (400, "expired_token")
    assert not ApiToken.objects.exists()


def test_an_unknown_or_malformed_device_code_is_refused(alice: User) -> None:
    assert error_of(poll("x" * 43)) == (400, "invalid_grant")
    for body in ({}, {"device_code": 12}, {"device_code": ""}):
        got = Client().post(TOKEN, body, content_type="application/json")
        assert error_of(got)[0] == 400, body
        assert got.json()["error"] in ("invalid", "invalid_grant"), body
    got = Client().post(
        TOKEN, {"device_code": "x" * 201}, content_type="application/json"
    )
    assert error_of(got) == (400, "invalid")


def test_a_disabled_account_gets_no_token(alice: User) -> None:
    started = start()
    decide(signed_in(alice), started["user_code"], "approve")
    alice.is_active = False
    alice.save()
    assert error_of(poll(started["device_code"])) == (400, "access_denied")
    assert not ApiToken.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_two_polls_at_once_get_one_token(alice: User) -> None:
    """The row is locked while a poll decides: with it held elsewhere, both polls
    wait on it (a plain read would not), then one gets the token, the other
    invalid_grant."""
    import psycopg

    from tests.e2e.conftest import database_url, wait_until

    started = start()
    decide(signed_in(alice), started["user_code"], "approve")
    row = row_of(started)
    lock = psycopg.connect(database_url())
    try:
        lock.execute(
            f"SELECT 1 FROM {DeviceAuthorization._meta.db_table} WHERE id = %s"
            " FOR UPDATE",
            [row.pk],
        )
        answers: list[Any] = []

        def redeem() -> None:
            from django.db import connection

            try:
                answers.append(tokens.redeem_device_code(started["device_code"]))
            except tokens.DeviceGrantError as exc:
                answers.append(exc.code)
            finally:
                connection.close()

        polls = [threading.Thread(target=redeem) for _ in range(2)]
        for t in polls:
            t.start()
        # Both wait on the row: one on the lock held here, one behind it.
        # (pg_locks: pg_stat_activity would be a snapshot for the transaction.)
        pid = lock.info.backend_pid
        waiting = (
            "SELECT count(DISTINCT l.pid) FROM pg_locks l WHERE NOT l.granted"
            " AND (%(me)s = ANY(pg_blocking_pids(l.pid)) OR EXISTS ("
            "  SELECT 1 FROM unnest(pg_blocking_pids(l.pid)) b"
            "  WHERE %(me)s = ANY(pg_blocking_pids(b))))"
        )
        wait_until(
            lambda: (lock.execute(waiting, {"me": pid}).fetchone() or (0,))[0] == 2,
            what="both polls waiting on the row",
        )
    finally:
        lock.commit()
        lock.close()
    for t in polls:
        t.join(30)
    issued = [a for a in answers if isinstance(a, tokens.Issued)]
    assert len(issued) == 1 and "invalid_grant" in answers, answers
    assert ApiToken.objects.filter(user=alice).count() == 1


# ------------------------------------------------------------------ limits and bad input


def test_new_codes_are_rate_limited_per_address(settings: Any) -> None:
    settings.GPULAB_DEVICE_CODE_RATE = 3
    settings.GPULAB_DEVICE_CODE_WINDOW = 600
    address = new_address()
    for _ in range(3):
        assert ask_code(address=address).status_code == 200
    got = ask_code(address=address)
    assert error_of(got) == (429, "throttled")
    assert 1 <= int(got["Retry-After"]) <= 201
    assert DeviceAuthorization.objects.count() == 3
    assert ask_code(address=new_address()).status_code == 200  # its own budget


def test_code_lookups_are_limited_per_user(
    alice: User, bob: User, settings: Any
) -> None:
    settings.GPULAB_DEVICE_VERIFY_RATE = 3
    started = start()
    web = signed_in(alice)
    for guess in ("BBBB-BBBB", "CCCC-CCCC", "DDDD-DDDD"):
        assert web.get(PAGE, {"code": guess}).status_code == 400
    # the right code, but too many tried: refused all the same
    got = web.get(PAGE, {"code": started["user_code"]})
    assert got.status_code == 429
    assert "Too many codes tried" in got.content.decode()
    assert signed_in(bob).get(PAGE, {"code": started["user_code"]}).status_code == 200
    assert row_of(started).status == "pending"


def test_a_wrong_or_malformed_user_code_is_named(alice: User) -> None:
    started = start()
    web = signed_in(alice)
    assert web.get(PAGE).status_code == 200  # the form to type it
    wrong = "BBBB-BBBB" if started["user_code"] != "BBBB-BBBB" else "CCCC-CCCC"
    got = web.get(PAGE, {"code": wrong})
    assert got.status_code == 400
    assert "No sign-in waits with this code" in got.content.decode()
    for bad in ("hello", "AEIO-UAEI", "BCDF-GHJK-L", ""):
        got = web.get(PAGE, {"code": bad})
        assert got.status_code == 400, bad
        assert "A code is 8 letters" in got.content.decode(), bad
    csrf = web.cookies["csrftoken"].value
    got = web.post(
        PAGE, {"code": wrong, "decision": "approve", "csrfmiddlewaretoken": csrf}
    )
    assert got.status_code == 400
    got = web.post(
        PAGE,
        {
            "code": started["user_code"],
            "decision": "maybe",
            "csrfmiddlewaretoken": csrf,
        },
    )
    assert got.status_code == 400 and "Choose Approve or Deny" in got.content.decode()
    assert row_of(started).status == "pending"
    assert DeviceAuthorization.objects.exclude(status="pending").count() == 0


def test_the_decision_needs_the_csrf_token(alice: User) -> None:
    started = start()
    got = signed_in(alice).post(
        PAGE, {"code": started["user_code"], "decision": "approve"}
    )
    assert got.status_code == 403
    assert row_of(started).status == "pending"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "Name the machine (e.g. its host name)."),
        ("   ", "Name the machine (e.g. its host name)."),
        (7, "Must be a string."),
        ("x" * 101, "Ensure this field has no more than 100 characters."),
        ("evil\x1b[2Jhost", "At most 100 printable characters."),
    ],
)
def test_a_bad_machine_name_is_named(name: Any, why: str) -> None:
    got = ask_code(name)
    assert error_of(got) == (400, "invalid")
    assert got.json()["fields"] == {"client_name": [why]}
    assert not DeviceAuthorization.objects.exists()


def test_approving_needs_room_for_one_more_token(alice: User, settings: Any) -> None:
    started = start()
    for n in range(tokens.MAX_TOKENS):
        tokens.create_token(alice, f"t{n}", None)
    got = decide(signed_in(alice), started["user_code"], "approve")
    assert got.status_code == 400
    assert "revoke one first" in got.content.decode()
    assert row_of(started).status == "pending"
