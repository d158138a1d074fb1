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
import fcntl
import hashlib
import os
import pwd
import stat
import subprocess
import sys
import tempfile
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


def _base() -> Path:
    """Where every ``traversable`` of this account keeps its shared files (per
    uid: only that uid may chmod its directories)."""
    return Path(tempfile.gettempdir()) / f"gpulab-traversable-{os.geteuid()}"


def _files_of(d: Path) -> tuple[Path, Path]:
    """The lock its users hold shared, and the record of its original mode."""
    key = hashlib.sha256(str(d).encode()).hexdigest()[:16]
    base = _base()
    return base.with_name(f"{base.name}-{key}.users"), base.with_name(
        f"{base.name}-{key}.mode"
    )


def _open_private(path: Path) -> int:
    """Open (create, mode 600) a file of ours in the shared temp directory, never
    through a symlink someone else planted there."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise AccountError(f"{path} belongs to another account; remove it")
    return fd


def _recorded_mode(path: Path) -> int | None:
    if not path.exists():
        return None
    with os.fdopen(_open_private(path), encoding="ascii") as fh:
        text = fh.read().strip()
    try:
        return int(text, 8) if text else None
    except ValueError:
        return None


def _record_mode(path: Path, mode: int) -> None:
    with os.fdopen(_open_private(path), "w", encoding="ascii") as fh:
        fh.truncate()
        fh.write(f"{mode:o}\n")


@contextlib.contextmanager
def traversable(
    *paths: Path, say: Callable[[str], object] = lambda _: None
) -> Iterator[list[Path]]:
    """Open the closed directories above ``paths`` for traversal by others
    (``o+x``) for the block; yields those this block opened. ``say`` is told each.

    Blocks may overlap, in one process or several (``make up`` beside the test
    suite's JupyterLab tests, two test workers): each directory opened this way
    has its original mode recorded, and every block that needs it (opening it or
    finding it opened) holds a shared lock on it; whoever leaves it last (an
    exclusive lock taken without waiting) restores the mode. Entering and leaving
    are serialised by one mutex. A block that dies leaves its directories open
    until the next block that uses them leaves."""
    mutex = _open_private(_base().with_suffix(".mutex"))
    held: list[tuple[Path, int]] = []
    opened: list[Path] = []
    try:
        with _held(mutex):
            for path in paths:
                for d in reversed(path.parents):
                    if any(d == h for h, _ in held):
                        continue
                    users_path, mode_path = _files_of(d)
                    mode = stat.S_IMODE(d.stat().st_mode)
                    if mode & stat.S_IXOTH and _recorded_mode(mode_path) is None:
                        continue  # open of its own: nothing to restore
                    users = _open_private(users_path)
                    fcntl.flock(users, fcntl.LOCK_SH)
                    held.append((d, users))
                    if not mode & stat.S_IXOTH:
                        if _recorded_mode(mode_path) is None:
                            _record_mode(mode_path, mode)
                        d.chmod(mode | stat.S_IXOTH)
                        opened.append(d)
                        say(
                            f"opened {d} for traversal (o+x) while the demo runs, so"
                            " demo jobs can start this Python"
                        )
        yield opened
    finally:
        with _held(mutex):
            for d, users in reversed(held):
                users_path, mode_path = _files_of(d)
                fcntl.flock(users, fcntl.LOCK_UN)
                try:
                    fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass  # another block still needs it: the last one restores
                else:
                    original = _recorded_mode(mode_path)
                    if original is not None:
                        with contextlib.suppress(FileNotFoundError):
                            d.chmod(original)
                        mode_path.unlink()
                finally:
                    os.close(users)
        os.close(mutex)


@contextlib.contextmanager
def _held(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
