"""Starting Django in a fresh interpreter with some environment variables set:
how a test sees that a bad setting stops the start (``ImproperlyConfigured``,
naming the variable) as it would stop a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def django_setup(
    env: dict[str, str], then: str = ""
) -> subprocess.CompletedProcess[str]:
    """``django.setup()`` with ``env`` over this process's environment, then the
    Python statements ``then`` (for example a ``print`` of a setting)."""
    return subprocess.run(
        [sys.executable, "-c", f"import django; django.setup()\n{then}"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
