"""The configuration ``make up`` gives its processes: a demo anyone may open runs
with DEBUG off (no debug pages listing the URL patterns, the product's own error
pages), and still lets people log in over plain HTTP on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

from portal.stack.embedded import REPO_ROOT
from portal.stack.up import portal_env

if TYPE_CHECKING:
    from pathlib import Path

SETTINGS = """
import json, django
django.setup()
from django.conf import settings
print(json.dumps({
    "debug": settings.DEBUG,
    "secure_cookies": settings.SESSION_COOKIE_SECURE,
    "email": settings.EMAIL_BACKEND,
    "workdirs": settings.GPULAB_WORKDIR_ALLOWED,
}))
"""


def test_make_up_runs_the_portal_with_debug_off_and_cookies_over_http(
    tmp_path: Path,
) -> None:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DJANGO_")
        and k not in {"GPULAB_EMAIL_BACKEND", "GPULAB_WORKDIR_ALLOWED"}
    }
    env = {**base, **portal_env(base, tmp_path, 8000)}
    env["DJANGO_SETTINGS_MODULE"] = "portal.settings"

    out = subprocess.run(
        [sys.executable, "-c", SETTINGS],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    assert json.loads(out.splitlines()[-1]) == {
        "debug": False,
        # http://127.0.0.1: a Secure-only session cookie would never come back
        "secure_cookies": False,
        # a demo has no mail server: mail is printed in its log
        "email": "django.core.mail.backends.console.EmailBackend",
        # `gpulab submit` from the checkout runs the job there (the current
        # directory): the demo allows it besides the usual directories
        "workdirs": ["/home", "/scratch", "/data", "/tmp", str(REPO_ROOT)],
    }


def test_a_debug_setting_given_to_make_up_is_kept(tmp_path: Path) -> None:
    added = portal_env({"DJANGO_DEBUG": "true"}, tmp_path, 8000)

    assert added["DJANGO_DEBUG"] == "true"
