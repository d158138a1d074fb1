"""The configuration ``make up`` gives its processes: a demo anyone may open runs
with DEBUG off (no debug pages listing the URL patterns, the product's own error
pages), and still lets people log in over plain HTTP on loopback."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from portal.stack import accounts
from portal.stack.embedded import REPO_ROOT
from portal.stack.up import DemoNode, portal_env, processes

root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="creating a Unix account needs root"
)

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


def test_make_up_gives_jobs_this_environments_jupyterlab(tmp_path: Path) -> None:
    """`make` does not activate the venv, so a demo job's PATH has no jupyter: the
    agents fall back to GPULAB_JUPYTER_COMMAND, which names the portal's own; one
    the user set is kept."""
    added = portal_env({}, tmp_path, 8000)
    jupyter = Path(sys.prefix) / "bin" / "jupyter"
    assert added["GPULAB_JUPYTER_COMMAND"] == str(jupyter)
    assert os.access(jupyter, os.X_OK)

    kept = portal_env({"GPULAB_JUPYTER_COMMAND": "/opt/lab/bin/jupyter"}, tmp_path, 1)
    assert "GPULAB_JUPYTER_COMMAND" not in kept


def test_demo_agents_run_jobs_as_the_demo_account_never_as_root() -> None:
    nodes = [DemoNode("demo-1", "4xA100-80GB"), DemoNode("demo-2", "4xA100-80GB")]

    as_root = processes(Path("/nonexistent"), nodes, 8000, "gpulab-demo")
    as_user = processes(Path("/nonexistent"), nodes, 8000, None)

    for node in nodes:
        argv = as_root[node.name]
        assert argv[argv.index("--default-account") + 1] == "gpulab-demo"
        assert "--allow-root-jobs" not in argv
        assert "--default-account" not in as_user[node.name]
        assert "--allow-root-jobs" not in as_user[node.name]


@root_only
def test_the_demo_account_is_created_once_and_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"gpulabd{os.getpid() % 100000}"
    monkeypatch.setattr(accounts, "DEFAULT_DEMO_ACCOUNT", name)
    try:
        assert accounts.demo_account({}) == name
        entry = pwd.getpwnam(name)
        assert entry.pw_uid != 0
        assert entry.pw_shell == "/bin/bash"
        assert Path(entry.pw_dir).is_dir()
        # the second `make up` finds it
        assert accounts.demo_account({"GPULAB_DEMO_ACCOUNT": name}) == name
        assert pwd.getpwnam(name).pw_uid == entry.pw_uid
    finally:
        subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)


@root_only
@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("no-such-account-here", "'no-such-account-here': no such Unix account"),
        ("root", "'root' is root (uid 0)"),
    ],
)
def test_a_demo_account_that_cannot_run_jobs_stops_make_up(
    given: str, says: str
) -> None:
    with pytest.raises(accounts.AccountError, match=re.escape(says)):
        accounts.demo_account({"GPULAB_DEMO_ACCOUNT": given})


def test_closed_directories_above_python_are_opened_for_traversal_only_meanwhile() -> (
    None
):
    # Not tmp_path: pytest's base directory is itself closed to others.
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o755)
    try:
        _opened_meanwhile(base / "home")
    finally:
        shutil.rmtree(base)


def _opened_meanwhile(closed: Path) -> None:
    (closed / "venv" / "bin").mkdir(parents=True)
    closed.chmod(0o700)
    python = closed / "venv" / "bin" / "python"
    python.touch()
    said: list[str] = []

    with accounts.traversable(python, closed / "venv" / "bin", say=said.append) as o:
        assert o == [closed]
        assert stat.S_IMODE(closed.stat().st_mode) == 0o701
        assert accounts.closed_dirs(python) == []
        assert len(said) == 1 and str(closed) in said[0]
    assert stat.S_IMODE(closed.stat().st_mode) == 0o700
    assert accounts.closed_dirs(python) == [closed]


def test_overlapping_traversals_restore_the_modes_when_the_last_one_leaves() -> None:
    """`make up` beside the suite's JupyterLab tests (or two test workers): the
    first to leave must not close a directory the other still needs."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o755)
    closed = base / "home"
    (closed / "bin").mkdir(parents=True)
    closed.chmod(0o700)
    python = closed / "bin" / "python"
    try:
        first = accounts.traversable(python)
        assert first.__enter__() == [closed]
        with accounts.traversable(python) as second:
            assert second == []  # already open: the first recorded its mode
            first.__exit__(None, None, None)
            assert stat.S_IMODE(closed.stat().st_mode) == 0o701  # still needed
        assert stat.S_IMODE(closed.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(base)


def test_a_traversal_of_other_directories_does_not_hold_back_a_restore() -> None:
    """A JupyterLab test keeping /root open must not keep `make up`'s own
    directories (or another test's) open after they are done with."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o755)
    one, two = base / "one", base / "two"
    for d in (one, two):
        (d / "bin").mkdir(parents=True)
        d.chmod(0o700)
    try:
        with accounts.traversable(one / "bin" / "python"):
            with accounts.traversable(two / "bin" / "python") as opened:
                assert opened == [two]
            assert stat.S_IMODE(two.stat().st_mode) == 0o700
            assert stat.S_IMODE(one.stat().st_mode) == 0o701
        assert stat.S_IMODE(one.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(base)
