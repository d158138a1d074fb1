"""A non-root Unix account that can run this checkout's JupyterLab.

JupyterLab refuses root and gpulab never overrides that, so the tests that start a
real JupyterLab run it as an account of their own (``GPULAB_TEST_ACCOUNT`` if
``.ci/run`` made one, else one created here with ``useradd``). The account must
reach the interpreter: a directory above it that others may not enter (pyenv
under ``/root``) is opened for traversal only (``o+x``, never listing) while the
tests run, and closed again after.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from portal.stack.accounts import interpreter_paths, traversable

if TYPE_CHECKING:
    from collections.abc import Iterator

root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="starting a job as another account needs root"
)


@contextlib.contextmanager
def jupyter_account() -> Iterator[pwd.struct_passwd]:
    """The account (created for the run unless ``GPULAB_TEST_ACCOUNT`` names one),
    able to run ``sys.executable`` and this venv's scripts."""
    given = os.environ.get("GPULAB_TEST_ACCOUNT", "")
    name = given or f"gpulabj{os.getpid() % 100000}"
    if not given:
        # A home of its own (JupyterLab writes its runtime files there).
        subprocess.run(
            [
                *("useradd", "--system", "--create-home"),
                *("--home-dir", f"/tmp/{name}", "--shell", "/bin/sh", name),
            ],
            check=True,
            capture_output=True,
        )
    try:
        with traversable(*interpreter_paths()):
            yield pwd.getpwnam(name)
    finally:
        if not given:
            subprocess.run(
                ["userdel", "--remove", name], check=False, capture_output=True
            )


@contextlib.contextmanager
def workdir_for(account: pwd.struct_passwd) -> Iterator[Path]:
    """A working directory in /tmp the account owns (its HOME too: JupyterLab
    writes its runtime files under it), removed after."""
    workdir = Path(tempfile.mkdtemp(prefix="gpulab-jupyter-", dir="/tmp"))
    try:
        workdir.chmod(0o755)
        os.chown(workdir, account.pw_uid, account.pw_gid)
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
