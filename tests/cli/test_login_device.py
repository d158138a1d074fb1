"""``gpulab login --browser`` against a live server (pytest-django's
``live_server``: every middleware, the API, Redis): how the CLI's poll loop
answers each state. A thread plays the user (or the clock) on the database
while the command polls; the poll interval is set to 1 s."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection
from django.utils import timezone

from portal.api import tokens
from portal.api.models import DeviceAuthorization
from tests.e2e.conftest import wait_until

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.contrib.auth.models import User

    from tests.cli.conftest import Gpulab

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _quick(settings: Any) -> None:
    settings.GPULAB_DEVICE_POLL_INTERVAL = 1
    settings.GPULAB_DEVICE_CODE_RATE = 1000  # the test client's address is shared


def meanwhile(act: Callable[[], None]) -> threading.Thread:
    """``act`` in a thread (the user at the browser) while the command runs."""

    def run() -> None:
        try:
            act()
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def the_row(**having: Any) -> DeviceAuthorization:
    row: DeviceAuthorization = wait_until(
        lambda: DeviceAuthorization.objects.filter(**having).first(),
        60,
        f"a device authorization with {having}",
    )
    return row


def test_an_approved_login_stores_the_token(gpulab: Gpulab, alice: User) -> None:
    def approve() -> None:
        row = the_row(last_polled_at__isnull=False)  # it shows the code and polls
        tokens.decide_device_login(alice, row.user_code, approve=True)

    user = meanwhile(approve)
    got = gpulab("login", "--browser", "--name", "ci-runner")
    user.join(30)
    assert got.exit_code == 0, got.output
    assert f"open {gpulab.server}/device/ and enter the code" in got.output
    assert "as alice (token 'ci-runner'" in got.output
    me = gpulab("whoami")
    assert me.exit_code == 0 and "token 'ci-runner'" in me.output


def test_after_slow_down_it_polls_less_often(gpulab: Gpulab, alice: User) -> None:
    def user_and_clock() -> None:
        row = the_row(last_polled_at__isnull=False)
        # its next poll comes "too soon": slow_down, 1 + 5 s from then on
        DeviceAuthorization.objects.filter(pk=row.pk).update(
            last_polled_at=timezone.now() + timedelta(seconds=30)
        )
        the_row(pk=row.pk, interval=6)
        tokens.decide_device_login(alice, row.user_code, approve=True)

    user = meanwhile(user_and_clock)
    got = gpulab("login", "--browser", "--name", "slow")
    user.join(30)
    assert got.exit_code == 0, got.output
    # had it polled again after 1 s, the server would have slowed it down again
    assert DeviceAuthorization.objects.get().interval == 6


def test_an_expired_code_ends_the_login(gpulab: Gpulab) -> None:
    def expire() -> None:
        row = the_row(last_polled_at__isnull=False)
        DeviceAuthorization.objects.filter(pk=row.pk).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )

    clock = meanwhile(expire)
    got = gpulab("login", "--browser")
    clock.join(30)
    assert got.exit_code == 3, got.output
    assert "the code expired before it was approved" in got.output
    assert not (gpulab.config_home / "gpulab" / "config.json").exists()


def test_token_and_browser_together_are_refused(gpulab: Gpulab) -> None:
    got = gpulab("login", "--browser", "--token")
    assert got.exit_code == 2
    assert "give --token or --browser, not both" in got.output
    assert not DeviceAuthorization.objects.exists()
