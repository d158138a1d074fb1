"""The Unix account ``make up`` runs its demo jobs as when it is run as root.

An agent started by root never runs a job as root unless told to, and JupyterLab
refuses root whatever it is told (gpulab never passes ``--allow-root``). So a
``make up`` run by root gives its demo agents ``--default-account`` with an
ordinary account: ``GPULAB_DEMO_ACCOUNT`` if set (it must exist), else
``gpulab-demo``, created once with ``useradd`` (a system account with a home and
bash) and kept.

The account must be able to start this checkout's Python (JupyterLab, the
training scripts): a directory above the interpreter that others may not enter
(pyenv under ``/root``, mode 0700) is opened for traversal only (``o+x``: entering
a known path, never listing) while the demo runs, and closed again when it stops.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

DEFAULT_DEMO_ACCOUNT = "gpulab-demo"


class AccountError(Exception):
    """The demo account cannot be had; the message says why and what to do."""


def demo_account(env: Mapping[str, str]) -> str | None:
    """The account demo jobs run as: None when ``make up`` is not root (jobs run
    as whoever runs it), else ``GPULAB_DEMO_ACCOUNT`` or ``gpulab-demo``, created
    when missing. Raises ``AccountError``."""
    if os.geteuid() != 0:
        return None
    given = env.get("GPULAB_DEMO_ACCOUNT", "").strip()
    name = given or DEFAULT_DEMO_ACCOUNT
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if given:
            raise AccountError(
                f"GPULAB_DEMO_ACCOUNT={name!r}: no such Unix account on this machine"
                " (create it, or unset GPULAB_DEMO_ACCOUNT to use"
                f" {DEFAULT_DEMO_ACCOUNT!r}, created for you)"
            ) from None
        entry = _create(name)
    if entry.pw_uid == 0:
        raise AccountError(
            f"GPULAB_DEMO_ACCOUNT={name!r} is root (uid 0): demo jobs, JupyterLab"
            " above all, need an ordinary account"
        )
    return name


def _create(name: str) -> pwd.struct_passwd:
    argv = ["useradd", "--system", "--create-home", "--shell", "/bin/bash", name]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise AccountError(
            f"cannot create the demo account {name!r}: {exc} (set"
            " GPULAB_DEMO_ACCOUNT to an existing ordinary account)"
        ) from None
    if result.returncode != 0:
        raise AccountError(
            f"`{' '.join(argv)}` failed (exit {result.returncode}):"
            f" {result.stderr.strip()} (set GPULAB_DEMO_ACCOUNT to an existing"
            " ordinary account)"
        )
    return pwd.getpwnam(name)


def closed_dirs(path: Path) -> list[Path]:
    """The directories above ``path``, outermost first, that other accounts may
    not traverse."""
    return [d for d in reversed(path.parents) if not d.stat().st_mode & stat.S_IXOTH]


def interpreter_paths() -> tuple[Path, Path]:
    """What a job must reach to run this checkout's Python and its scripts."""
    return Path(os.path.realpath(sys.executable)), Path(sys.prefix) / "bin"


@contextlib.contextmanager
def traversable(
    *paths: Path, say: Callable[[str], object] = lambda _: None
) -> Iterator[list[Path]]:
    """Open the closed directories above ``paths`` for traversal by others
    (``o+x``) for the block, restoring their modes after; yields those opened.
    ``say`` is told each one."""
    opened: list[tuple[Path, int]] = []
    try:
        for path in paths:
            for d in closed_dirs(path):
                if all(d != o for o, _ in opened):
                    mode = stat.S_IMODE(d.stat().st_mode)
                    d.chmod(mode | stat.S_IXOTH)
                    opened.append((d, mode))
                    say(
                        f"opened {d} for traversal (o+x) while the demo runs, so"
                        " demo jobs can start this Python"
                    )
        yield [d for d, _ in opened]
    finally:
        for d, mode in reversed(opened):
            d.chmod(mode)
