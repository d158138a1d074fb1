"""A wrong OpenID Connect setting stops the process at start with a message naming
it (the settings module imported in a fresh interpreter, as the web process does)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT

ON = {
    "GPULAB_OIDC_DISCOVERY_URL": "https://sso.example.org/realms/lab",
    "GPULAB_OIDC_CLIENT_ID": "gpulab",
    "GPULAB_OIDC_CLIENT_SECRET": "s3cret",
}


def start(
    env: dict[str, str],
    code: str = "import portal.settings as s; print(s.OIDC_RP_SCOPES)",
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPULAB_OIDC_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, "DJANGO_SECRET_KEY": "x" * 50, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_complete_configuration_starts() -> None:
    done = start(ON)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "openid email profile"


def test_beat_refreshes_the_users_only_when_oidc_is_on() -> None:
    show = (
        "import portal.settings as s; print(s.CELERY_BEAT_SCHEDULE.get('oidc-refresh'))"
    )
    on = start({**ON, "GPULAB_OIDC_REFRESH_INTERVAL": "600"}, show)
    assert on.returncode == 0, on.stderr
    assert "'task': 'portal.oidc.tasks.refresh', 'schedule': 600.0" in on.stdout
    off = start({}, show)
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "None"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {**ON, "GPULAB_OIDC_DISCOVERY_URL": "sso.example.org"},
            "GPULAB_OIDC_DISCOVERY_URL='sso.example.org' is not an http(s) URL",
        ),
        (
            {k: v for k, v in ON.items() if k != "GPULAB_OIDC_CLIENT_ID"},
            "GPULAB_OIDC_CLIENT_ID is not set",
        ),
        (
            {k: v for k, v in ON.items() if k != "GPULAB_OIDC_CLIENT_SECRET"},
            "GPULAB_OIDC_CLIENT_SECRET is not set",
        ),
        (
            {**ON, "GPULAB_OIDC_SCOPES": "email profile"},
            "GPULAB_OIDC_SCOPES='email profile' must include the scope openid",
        ),
        (
            {**ON, "GPULAB_OIDC_UID_CLAIM": "uid"},
            "GPULAB_OIDC_UID_CLAIM and GPULAB_OIDC_GID_CLAIM go together",
        ),
        (
            {**ON, "GPULAB_OIDC_GIDS_CLAIM": "gids"},
            "GPULAB_OIDC_GIDS_CLAIM needs GPULAB_OIDC_UID_CLAIM",
        ),
        (
            {**ON, "GPULAB_OIDC_SIGN_ALGO": "none"},
            "GPULAB_OIDC_SIGN_ALGO='none' is not one of",
        ),
        (
            {**ON, "GPULAB_OIDC_TOKEN_KEY": "long-enough-passphrase-1,short"},
            "GPULAB_OIDC_TOKEN_KEY: each key must be at least 16 characters",
        ),
        (
            {**ON, "GPULAB_OIDC_REFRESH_INTERVAL": "5"},
            "GPULAB_OIDC_REFRESH_INTERVAL",
        ),
    ],
)
def test_a_wrong_setting_stops_the_process_naming_it(
    env: dict[str, str], says: str
) -> None:
    done = start(env)
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr
    assert says in done.stderr


def test_check_warns_when_offline_access_is_not_asked() -> None:
    """``manage.py check`` (run by migrate) warns, naming the scopes, when the
    refresh could read an expired token as a removal; asking for it is quiet."""
    check = (
        "import django; django.setup(); "
        "from django.core.management import call_command; call_command('check')"
    )
    without = start(ON, check)
    assert "gpulab.W001" in without.stderr
    assert "GPULAB_OIDC_SCOPES='openid email profile' does not ask" in without.stderr
    asked = start({**ON, "GPULAB_OIDC_SCOPES": "openid profile offline_access"}, check)
    assert "gpulab.W001" not in asked.stderr + asked.stdout
    off = start({}, check)
    assert "gpulab.W001" not in off.stderr + off.stdout
