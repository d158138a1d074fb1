"""``python -m portal.stack.up``: the ``make up`` supervisor.

1. Check ``GPULAB_DEMO_NODES`` and ``PORT`` before starting anything.
2. Start the embedded PostgreSQL / Redis that the URLs do not configure.
3. Keep a secret key in ``<state>/secret_key``; DEBUG off, cookies over plain HTTP,
   mail printed in the log and this environment's JupyterLab, unless set
   (``portal_env``). Run by root: demo jobs run as an ordinary account
   (``portal.stack.accounts``), never as root.
4. ``migrate``, ``ensure_admin``, ``create_node demo-N --if-missing`` per demo node.
5. Run web, worker, beat and one simulated agent per demo node under honcho, with
   prefixed, coloured output; say where the portal is once web answers.
6. Ctrl-C / SIGTERM stops them all, then the embedded servers unless another entry
   point (``make test``) still uses them. If one process dies, the rest are stopped
   and we exit non-zero naming it.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from honcho.manager import (  # type: ignore[import-untyped]
    SYSTEM_PRINTER_NAME,
    Manager,
)
from honcho.printer import Message, Printer  # type: ignore[import-untyped]

from portal.stack.accounts import (
    AccountError,
    demo_account,
    interpreter_paths,
    traversable,
)
from portal.stack.embedded import REPO_ROOT, StackError, ensure_services, secret_key

if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import FrameType

DEFAULT_PORT = 8000
DEFAULT_DEMO_NODES = "2x4:A100-80GB"
HOST = "127.0.0.1"


class UpError(Exception):
    """A problem the user can fix; the message says how."""


@dataclass(frozen=True)
class DemoNode:
    name: str
    spec: str


def demo_nodes(env: Mapping[str, str]) -> list[DemoNode]:
    """``demo-1``, ``demo-2``, ... from ``GPULAB_DEMO_NODES`` (a cluster spec)."""
    from agents.spec import SpecError, parse_cluster_spec

    raw = env.get("GPULAB_DEMO_NODES", "").strip() or DEFAULT_DEMO_NODES
    try:
        nodes = parse_cluster_spec(raw)
    except SpecError as exc:
        raise UpError(
            f"GPULAB_DEMO_NODES={raw!r} is not a cluster spec: {exc} "
            f"(expected e.g. {DEFAULT_DEMO_NODES!r} or '8x4:p100+4x8:k80')"
        ) from None
    return [DemoNode(f"demo-{i}", str(node)) for i, node in enumerate(nodes, 1)]


def port(env: Mapping[str, str]) -> int:
    raw = env.get("PORT", "").strip() or str(DEFAULT_PORT)
    try:
        number = int(raw)
    except ValueError:
        raise UpError(f"PORT={raw!r} is not a port number") from None
    if not 1 <= number <= 65535:
        raise UpError(f"PORT={number} must be between 1 and 65535")
    return number


def check_port_free(number: int) -> None:
    """Fail early, with the fix, rather than let uvicorn die after setup."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, number))
    except OSError:
        raise UpError(
            f"port {number} on {HOST} is busy (another `make up`?): stop what "
            f"listens there or choose another port, e.g. `PORT={number + 1} make up`"
        ) from None
    finally:
        sock.close()


def port_answers(number: int) -> bool:
    try:
        with socket.create_connection((HOST, number), timeout=0.5):
            return True
    except OSError:
        return False


def manage(*args: str) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "manage.py"), *args]


def setup_steps(state: Path, nodes: list[DemoNode]) -> list[list[str]]:
    steps = [manage("migrate", "--noinput"), manage("ensure_admin")]
    for node in nodes:
        token = state / "agents" / node.name / "token"
        steps.append(
            manage("create_node", node.name, "--token-file", str(token), "--if-missing")
        )
    return steps


def web_argv(number: int, host: str = HOST) -> list[str]:
    """The ASGI server's command line: ``make up``'s, the tests' and the
    screenshots' web process are the same server with the same options."""
    return [
        sys.executable, "-m", "uvicorn", "portal.asgi:application",
        "--host", host, "--port", str(number),
        # A websocket frame is never buffered past this (agents' frames are
        # at most 1 MiB: protocol.MAX_FRAME_BYTES, refused with a reason).
        "--ws-max-size", "2097152",
        # An idle keep-alive connection is closed by the client first: with
        # uvicorn's 5 s, the same as httpx's (the CLI's), a request sent on a
        # connection the server is closing fails (ReadError; 47 in a burst).
        "--timeout-keep-alive", "75",
    ]  # fmt: skip


def processes(
    state: Path, nodes: list[DemoNode], number: int, account: str | None = None
) -> dict[str, list[str]]:
    """Name -> argv of every long-running process (DESIGN.md "Processes");
    ``account``: the agents' ``--default-account`` (``make up`` run by root)."""
    py = sys.executable
    procs = {
        "web": web_argv(number),
        "worker": [
            py, "-m", "celery", "-A", "portal", "worker",
            "--loglevel", "INFO", "--concurrency", "2",
        ],
        # Notification deliveries only (webhooks may be slow): never a pass.
        "notifier": [
            py, "-m", "celery", "-A", "portal", "worker", "--loglevel", "INFO",
            "--concurrency", "2", "--hostname", "notifier@%h",
            "-Q", f"{os.environ.get('GPULAB_REDIS_PREFIX') or 'gpulab'}.notifications",
        ],
        "beat": [
            py, "-m", "celery", "-A", "portal", "beat", "--loglevel", "INFO",
            "--schedule", str(state / "celerybeat-schedule"),
        ],
    }  # fmt: skip
    for node in nodes:
        node_dir = state / "agents" / node.name
        procs[node.name] = [
            py, "-m", "agents",
            "--server", f"ws://{HOST}:{number}",
            "--token-file", str(node_dir / "token"),
            "--simulate", node.spec,
            "--state-dir", str(node_dir),
            # Simulated GPU uuids derive from the host name: give each demo node
            # its own, or two nodes on this machine would report the same GPUs.
            "--hostname", node.name,
            # Jobs run as whoever runs `make up`; run by root, as the demo
            # account (portal.stack.accounts), never as root.
            *(["--default-account", account] if account else []),
        ]  # fmt: skip
    return procs


class _Supervisor(Manager):  # type: ignore[misc]
    """honcho's Manager, remembering which process stopped first and why."""

    def __init__(self, printer: Printer) -> None:
        super().__init__(printer=printer)
        self.first_dead: list[str] = []

    def terminate(self) -> None:
        if not self._terminating:
            # Called by loop() when a process stopped, or by the signal handler
            # (then nothing has stopped yet).
            self.first_dead = [
                name for name, p in self._processes.items() if "returncode" in p
            ]
        super().terminate()

    def say(self, text: str) -> None:
        self.events.put(
            Message(
                type="line",
                data=text + "\n",
                time=datetime.now(),
                name=SYSTEM_PRINTER_NAME,
                colour=None,
            )
        )


def _announce_when_up(manager: _Supervisor, number: int, stop: threading.Event) -> None:
    while not stop.is_set():
        if port_answers(number):
            manager.say(f"gpulab is running at http://{HOST}:{number}")
            return
        stop.wait(0.2)


def _raise_interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def portal_env(env: Mapping[str, str], state: Path, number: int) -> dict[str, str]:
    """What ``make up`` adds to the environment of its processes."""
    added: dict[str, str] = {}
    if not env.get("DJANGO_SECRET_KEY") and not env.get("DJANGO_SECRET_KEY_FILE"):
        added["DJANGO_SECRET_KEY"] = secret_key(state)
    # DEBUG off, as anyone opening the demo should see it: no debug pages, the
    # product's error pages; static files come from WhiteNoise either way.
    added["DJANGO_DEBUG"] = env.get("DJANGO_DEBUG", "false")
    # Plain HTTP on loopback: a Secure-only session cookie would never come back.
    added["DJANGO_SECURE_COOKIES"] = env.get("DJANGO_SECURE_COOKIES", "false")
    # No mail server in a demo: mail is printed in the log.
    added["GPULAB_EMAIL_BACKEND"] = env.get("GPULAB_EMAIL_BACKEND", "console")
    added["PYTHONUNBUFFERED"] = "1"
    # JupyterLab comes with the portal's environment, which `make` does not put on
    # the PATH the demo's jobs inherit (agents.jupyter falls back to this).
    jupyter = Path(sys.prefix) / "bin" / "jupyter"
    if not env.get("GPULAB_JUPYTER_COMMAND") and jupyter.exists():
        added["GPULAB_JUPYTER_COMMAND"] = str(jupyter)
    # The demo's jobs run on this machine: besides the usual directories, the
    # checkout, where `gpulab submit` (whose default is the current directory)
    # is run from.
    added["GPULAB_WORKDIR_ALLOWED"] = env.get("GPULAB_WORKDIR_ALLOWED") or ",".join(
        ["/home", "/scratch", "/data", "/tmp", str(REPO_ROOT)]
    )
    added["GPULAB_DEMO_NODES"] = env.get("GPULAB_DEMO_NODES") or DEFAULT_DEMO_NODES
    added["PORT"] = str(number)
    return added


def up(env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    try:
        nodes = demo_nodes(env)
        number = port(env)
        check_port_free(number)
    except UpError as exc:
        sys.stderr.write(f"gpulab: {exc}\n")
        return 2

    # SIGTERM during setup unwinds like Ctrl-C so the servers get stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    services = None
    try:
        services = ensure_services(env)
        env.update(services.env)
        state = Path(services.env["GPULAB_STATE_DIR"])
        env.update(portal_env(env, state, number))
        for node in nodes:
            (state / "agents" / node.name).mkdir(
                mode=0o700, parents=True, exist_ok=True
            )

        for step in setup_steps(state, nodes):
            shown = shlex.join(["manage.py", *step[2:]])
            sys.stdout.write(f"gpulab: {shown}\n")
            sys.stdout.flush()
            result = subprocess.run(step, env=env, cwd=REPO_ROOT, check=False)
            if result.returncode != 0:
                sys.stderr.write(
                    f"gpulab: `{shown}` failed (exit {result.returncode}); "
                    f"not starting the portal\n"
                )
                return 1

        account = demo_account(env)
        if account is None:
            return _supervise(state, nodes, number, env)
        sys.stdout.write(f"gpulab: demo jobs run as the Unix account {account}\n")
        with traversable(*interpreter_paths(), say=_say):
            return _supervise(state, nodes, number, env, account)
    except (StackError, AccountError) as exc:
        sys.stderr.write(f"gpulab: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("gpulab: interrupted\n")
        return 130
    finally:
        # A second Ctrl-C must not cut the servers' shutdown short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if services is not None:
            sys.stdout.write("gpulab: stopping embedded servers\n")
            sys.stdout.flush()
            shared = services.stop()
            if shared:
                sys.stdout.write(
                    f"gpulab: the embedded {' and '.join(shared)} kept running: "
                    f"another gpulab process (make test, make up) uses them\n"
                )


def _say(text: str) -> None:
    sys.stdout.write(f"gpulab: {text}\n")
    sys.stdout.flush()


def _supervise(
    state: Path,
    nodes: list[DemoNode],
    number: int,
    env: dict[str, Any],
    account: str | None = None,
) -> int:
    printer = Printer(sys.stdout, colour=sys.stdout.isatty())
    manager = _Supervisor(printer)
    for name, argv in processes(state, nodes, number, account).items():
        # exec: the shell honcho starts is replaced, so its SIGTERM reaches us.
        manager.add_process(name, "exec " + shlex.join(argv), env=env, cwd=REPO_ROOT)
    stop = threading.Event()
    watcher = threading.Thread(
        target=_announce_when_up, args=(manager, number, stop), daemon=True
    )
    watcher.start()
    started = time.monotonic()
    try:
        manager.loop()
    finally:
        stop.set()
    if manager.first_dead:
        names = ", ".join(manager.first_dead)
        codes = ", ".join(
            str(manager._processes[n].get("returncode")) for n in manager.first_dead
        )
        sys.stderr.write(
            f"gpulab: {names} stopped (exit {codes}) after "
            f"{time.monotonic() - started:.0f}s; stopped everything else\n"
        )
        return 1
    return 0


def main() -> None:
    sys.exit(up())


if __name__ == "__main__":
    main()
