"""Recovering the demo's lost admin password with the embedded servers in the
state dir (``make up``'s), as the docs say: ``python -m portal.stack.run --
python manage.py reset_admin_password``. Setting ``DJANGO_SUPERUSER_PASSWORD`` and
running ``make up`` again changes nothing (``ensure_admin`` leaves an existing
admin alone); the reset takes that variable or prints a new password."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from portal.stack.embedded import REPO_ROOT

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(300)

CHECK = """
import sys, django
django.setup()
from django.contrib.auth import authenticate
user = authenticate(username="admin", password=sys.argv[1])
print("accepted" if user is not None and user.is_superuser else "refused")
"""


def under_the_stack(state: Path, *command: str, **env: str) -> str:
    """``command`` (after ``manage.py``, or ``-c CODE``) run by
    ``python -m portal.stack.run`` on the embedded servers of ``state``."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}
        and not k.startswith(("DJANGO_", "GPULAB_"))
    }
    target = (
        [sys.executable, *command]
        if command[0] == "-c"
        else [sys.executable, "manage.py", *command]
    )
    done = subprocess.run(
        [sys.executable, "-m", "portal.stack.run", "--", *target],
        env={
            **clean,
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "GPULAB_STATE_DIR": str(state),
            **env,
        },
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_lost_admin_password_is_reset_on_the_embedded_servers(
    short_state_dir: Path,
) -> None:
    state = short_state_dir
    under_the_stack(state, "migrate", "--verbosity", "0")
    first = under_the_stack(state, "ensure_admin")
    assert "created admin user 'admin' with password" in first  # and then lost

    # What people try first: it leaves the existing admin alone.
    under_the_stack(state, "ensure_admin", DJANGO_SUPERUSER_PASSWORD="chosen-pw-1")
    assert "refused" in under_the_stack(state, "-c", CHECK, "chosen-pw-1")

    # The documented recovery, with a password of one's choosing ...
    said = under_the_stack(
        state, "reset_admin_password", DJANGO_SUPERUSER_PASSWORD="chosen-pw-1"
    )
    assert "chosen-pw-1" not in said  # never echoed
    assert "accepted" in under_the_stack(state, "-c", CHECK, "chosen-pw-1")

    # ... or a new one, printed once.
    said = under_the_stack(state, "reset_admin_password")
    match = re.search(r"new password '([^']+)'", said)
    assert match, said
    assert "accepted" in under_the_stack(state, "-c", CHECK, match.group(1))
    assert "refused" in under_the_stack(state, "-c", CHECK, "chosen-pw-1")
