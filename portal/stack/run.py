"""``python -m portal.stack.run [--] CMD...``: run CMD with PostgreSQL and Redis.

Starts the embedded servers that ``DATABASE_URL`` / ``REDIS_URL`` do not configure,
exports the URLs (and ``GPULAB_STATE_DIR``; ``DJANGO_SECRET_KEY`` from
``<state>/secret_key`` when unset) to CMD, returns CMD's exit code
(128 + N when a signal N ended it) and stops the embedded servers unless another
entry point still uses them (``portal.stack.embedded``, "Sharing"). ``make test`` is
``python -m portal.stack.run -- python -m pytest``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from portal.stack.embedded import StackError, ensure_services, secret_key

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import FrameType

USAGE = "usage: python -m portal.stack.run [--] CMD [ARG...]"


def run(argv: Sequence[str]) -> int:
    """Run ``argv`` (the command) under the stack; return its exit code."""
    command = list(argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command[0] in {"-h", "--help"}:
        sys.stderr.write(USAGE + "\n")
        return 0 if command else 2
    try:
        services = ensure_services()
    except StackError as exc:
        sys.stderr.write(f"gpulab: {exc}\n")
        return 1
    with services:
        env = {**os.environ, **services.env}
        if not env.get("DJANGO_SECRET_KEY") and not env.get("DJANGO_SECRET_KEY_FILE"):
            # Settings refuse to start without one (unless DEBUG); a dev command
            # gets the demo's key, kept in the state dir.
            env["DJANGO_SECRET_KEY"] = secret_key(
                Path(services.env["GPULAB_STATE_DIR"])
            )
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as exc:
            sys.stderr.write(f"gpulab: cannot run {command[0]!r}: {exc.strerror}\n")
            return 127

        def forward(signum: int, _frame: FrameType | None) -> None:
            # Ctrl-C already reached the child (same process group); SIGTERM sent
            # to us alone is passed on. Either way we wait for the child, then stop
            # the servers.
            if signum != signal.SIGINT:
                child.send_signal(signum)

        previous = {
            sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            returncode = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 128 - returncode if returncode < 0 else returncode


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
