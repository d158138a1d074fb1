"""One client cannot fill the API queue (portal/gate.py), on the real server.

With one API call running at a time and one place per client: a client whose
call is in is told 429 ``throttled`` with ``Retry-After`` at once, before
anything runs, while another client's call is taken and answered."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import hold_a_call, new_bearer

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120), pytest.mark.web_only]


@pytest.mark.web_env(GPULAB_WEB_API_CONCURRENCY=1, GPULAB_WEB_API_PER_CLIENT=1)
def test_a_client_with_its_call_in_gets_429_and_another_is_answered(
    stack: Stack, alice: User, bob: User
) -> None:
    me = f"{stack.base_url}/api/v1/me/"
    held = hold_a_call(me, alice, "script")  # Alice's call: the one running place
    bobs = new_bearer(bob, "cli")

    again = httpx.get(me, headers=held.headers)
    assert again.status_code == 429
    assert again.headers["Retry-After"] == "1"
    assert again.json() == {
        "error": "throttled",
        "detail": "Too many requests at once from this client (at most 1); "
        "try again in 1 s.",
        "fields": {},
    }

    answer: list[httpx.Response] = []
    bobs_call = threading.Thread(
        target=lambda: answer.append(httpx.get(me, headers=bobs, timeout=60))
    )
    bobs_call.start()
    held.release()  # Alice's call ends: Bob's (waiting, or arriving) runs
    bobs_call.join(timeout=60)
    assert answer[0].status_code == 200
    assert answer[0].json()["username"] == bob.username
    # Alice's place was given back with her answer
    assert httpx.get(me, headers=held.headers).status_code == 200
