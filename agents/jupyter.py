"""JupyterLab for an interactive job (``interactive="jupyter"`` in ``job.launch``).

The agent replaces the job's command with ``exec <jupyter> lab ...`` before the
shim runs it, so JupyterLab runs like any batch command: as the job's Unix
account, in its working directory, with its ``CUDA_VISIBLE_DEVICES``, killed at
its limit. What is chosen here:

- **which jupyter**: the first ``jupyter`` on the PATH the job's environment
  gives (its own ``PATH``, else the agent's, as the shim passes it on), else
  ``GPULAB_JUPYTER_COMMAND`` from the agent's environment (an executable and
  arguments to put before ``lab``). None: the launch fails, saying so.
- **never as root**: a job that would run as root (the agent is root and the
  launch names no other account) fails to launch; ``--allow-root`` is never given.
- **where**: the node's address ``GPULAB_JUPYTER_HOST`` (default: the address
  the node's host name resolves to) on a port free when the launch is prepared,
  with ``port_retries=0`` so that a port taken meanwhile fails the start rather
  than moving to a port the portal does not know.
- **the token**: the portal's secret, passed in ``JUPYTER_TOKEN`` (never on the
  command line, which every account on the node can read); the portal's proxy
  presents it, the browser never sees it.

``interactive.json`` in the job directory records host, port and the command
(reported in ``job.started``); ``ready`` is written once the port answers. A
JupyterLab that exits before it is ready is a launch failure, its last output
the reason (``early_exit``; only ``ready`` tells, as another process may hold
the port by then).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agents.shim import LaunchError, resolve_run_as
from agents.statedir import atomic_write, read_text

if TYPE_CHECKING:
    from pathlib import Path

    from agents.protocol import JobLaunchData

INFO_FILE = "interactive.json"
READY_FILE = "ready"
# How much of the output's end an early exit quotes.
TAIL_CHARS = 600


@dataclass(frozen=True)
class Server:
    """Where an interactive job's server listens, and what ran."""

    host: str
    port: int
    command: str


def node_host() -> str:
    """The address JupyterLab binds to: ``GPULAB_JUPYTER_HOST``, else the node's
    host name's address (the portal must reach it: docs/interactive.md)."""
    host = os.environ.get("GPULAB_JUPYTER_HOST", "").strip()
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the kernel's choice)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_jupyter(job_env: dict[str, str]) -> list[str]:
    """The jupyter to run (argv before ``lab``), or ``LaunchError`` naming where
    it was looked for."""
    path = job_env.get("PATH") or os.environ.get("PATH", "")
    found = shutil.which("jupyter", path=path)
    if found:
        return [found]
    fallback = os.environ.get("GPULAB_JUPYTER_COMMAND", "").strip()
    if fallback:
        try:
            argv = shlex.split(fallback)
        except ValueError as exc:
            raise LaunchError(f"GPULAB_JUPYTER_COMMAND is malformed: {exc}") from None
        if argv:
            return argv
    raise LaunchError(
        f"no jupyter on the job's PATH ({path or 'empty'}) and"
        " GPULAB_JUPYTER_COMMAND is not set on this node: install JupyterLab in"
        " the environment the job's PATH gives, or ask an admin to set it"
    )


def refuse_root(data: JobLaunchData) -> None:
    """``LaunchError`` if the server would run as root (JupyterLab refuses it, and
    gpulab never overrides that with ``--allow-root``)."""
    account = resolve_run_as(data.model_dump())
    if account is None and os.geteuid() == 0:
        raise LaunchError(
            "JupyterLab is never run as root, and this job has no other Unix"
            " account on this node (give the user a Unix account: their profile's"
            " unix account, or the agent's --default-account)"
        )


def prepare(data: JobLaunchData) -> tuple[JobLaunchData, Server]:
    """The launch with its command replaced by JupyterLab's, and where it will
    listen. Raises ``LaunchError`` (no jupyter, root, no token)."""
    if not data.interactive_token:
        raise LaunchError("the launch carries no token for JupyterLab")
    refuse_root(data)
    jupyter = find_jupyter(dict(data.env))
    host = node_host()
    try:
        port = free_port(host)
    except OSError as exc:
        raise LaunchError(
            f"cannot bind a port on {host} (GPULAB_JUPYTER_HOST): {exc}"
        ) from None
    argv = [
        *jupyter,
        "lab",
        "--no-browser",
        f"--ServerApp.ip={host}",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.base_url={data.interactive_base_url or '/'}",
    ]
    command = shlex.join(argv)
    env = {**data.env, "JUPYTER_TOKEN": data.interactive_token}
    launch = data.model_copy(update={"command": "exec " + command, "env": env})
    return launch, Server(host, port, command)


def record(job_dir: Path, server: Server) -> None:
    atomic_write(
        job_dir / INFO_FILE,
        json.dumps(
            {"host": server.host, "port": server.port, "command": server.command}
        ),
    )


def recorded(job_dir: Path) -> Server | None:
    """The server recorded for the job, None for a batch job."""
    text = read_text(job_dir / INFO_FILE)
    if text is None:
        return None
    try:
        info = json.loads(text)
        return Server(str(info["host"]), int(info["port"]), str(info["command"]))
    except (ValueError, KeyError, TypeError):
        return None


def check_ready(job_dir: Path, server: Server, timeout: float = 0.2) -> bool:
    """Whether the server answers on its port (``ready`` written the first time)."""
    if (job_dir / READY_FILE).exists():
        return True
    try:
        socket.create_connection((server.host, server.port), timeout=timeout).close()
    except OSError:
        return False
    atomic_write(job_dir / READY_FILE, "1\n")
    return True


def early_exit(job_dir: Path, code: int) -> str | None:
    """Why an interactive job that exited by itself failed to start (it exited
    before its port answered), None if it had been ready or is no server."""
    server = recorded(job_dir)
    if server is None or (job_dir / READY_FILE).exists():
        return None
    tail = ""
    with contextlib.suppress(OSError), (job_dir / "output.log").open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - 4 * TAIL_CHARS))
        text = fh.read().decode("utf-8", errors="replace").strip()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        tail = " | ".join(lines[-3:])[-TAIL_CHARS:]
    said = f"; its last output: {tail}" if tail else ""
    return (
        f"JupyterLab exited with code {code} before it listened on"
        f" {server.host}:{server.port}{said}"
    )
