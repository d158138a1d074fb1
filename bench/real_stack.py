"""The portal's real processes for benchmarks, as ``make up`` runs them.

A fresh database (created, migrated, dropped at the end), then web (uvicorn),
worker, notifier, beat and one simulated agent per node with the very argv
``portal.stack.up.processes`` gives ``make up``. Each process's output is kept
line by line with the time it was read, so a bench can wait for a line and read
the processes' own log timestamps (every process logs ``%(asctime)s``; they run
with ``TZ=UTC`` on this machine's one clock). ``interactive_stack`` adds what
the interactive benches share: a Unix account for their jobs, the bench's users
and API client, and agents that find this venv's JupyterLab.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_scaling import _admin_conninfo, _with_db, setup_django

if TYPE_CHECKING:
    import pwd
    from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]

# "2026-11-23 21:08:30,123" (logging's asctime) or celery's "[2026-11-23 21:08:30,123:"
_ASCTIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def log_time(line: str) -> float | None:
    """The epoch time a log line carries (its asctime, UTC), or None."""
    m = _ASCTIME.search(line)
    if m is None:
        return None
    at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return at.timestamp() + int(m.group(2)) / 1000


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def machine() -> dict[str, Any]:
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "mem_gib": round(mem_kib / 1024 / 1024, 1),
    }


def bench_record(**settings: Any) -> dict[str, Any]:
    """A bench's result to start from: this machine, the load average now and
    the run's ``settings``; prints the first two, which its figures are read
    beside."""
    record = {"machine": machine(), "load_start": loadavg(), **settings}
    print(
        f"machine: {record['machine']}; load average at start: {record['load_start']}",
        flush=True,
    )
    return record


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def fresh_database(label: str) -> Iterator[str]:
    """A new database on ``DATABASE_URL``'s server, migrated, with Django set up
    on it (and a Redis prefix of its own); dropped afterwards."""
    url = os.environ["DATABASE_URL"]
    name = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        db_url = _with_db(url, name)
        setup_django(db_url)
        yield db_url
    finally:
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def start_reader(self) -> None:
        def pump() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                with self.cond:
                    self.lines.append((time.time(), line.rstrip("\n")))
                    self.cond.notify_all()
            with self.cond:
                self.cond.notify_all()

        threading.Thread(target=pump, name=f"log-{self.name}", daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 90.0) -> str:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for _, line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.lines)
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(f"{self.name}: no {pattern!r}:\n{self.tail()}")
                self.cond.wait(remaining)

    def matching(self, pattern: str) -> list[tuple[float, str]]:
        regex = re.compile(pattern)
        with self.cond:
            return [(t, line) for t, line in self.lines if regex.search(line)]

    def tail(self, last: int = 40) -> str:
        with self.cond:
            return "\n".join(line for _, line in self.lines[-last:])


@dataclass
class RealStack:
    """``make up``'s processes on the bench's database."""

    state: Path
    port: int
    env: dict[str, str]
    procs: dict[str, Proc] = field(default_factory=dict)
    nodes: list[Any] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, name: str, argv: list[str]) -> Proc:
        popen = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip
        proc = Proc(name, popen)
        proc.start_reader()
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.popen.wait(20)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        # Jobs run under shims in their own sessions, which outlive the agents.
        for pgid_file in self.state.glob("agents/*/jobs/*/pgid"):
            with contextlib.suppress(OSError, ValueError):
                pgid = int(pgid_file.read_text().split()[0])
                if pgid > 1 and pgid != os.getpgrp():
                    os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def real_stack(
    db_url: str, state: Path, cluster: str, extra_env: dict[str, str] | None = None
) -> Iterator[RealStack]:
    """Start web, worker, notifier, beat and the ``cluster``'s simulated agents
    (``make up``'s argv); return once every node is UP with its GPUs."""
    from portal.stack.up import demo_nodes, processes
    from scheduler import services
    from scheduler.models import Gpu, Node

    nodes = demo_nodes({"GPULAB_DEMO_NODES": cluster})
    for node in nodes:
        _, token = services.create_node(node.name)
        token_file = state / "agents" / node.name / "token"
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.write_text(token)
        token_file.chmod(0o600)
    from django.db import connections

    connections.close_all()
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "PYTHONUNBUFFERED": "1",
        "TZ": "UTC",
        "DJANGO_SECURE_COOKIES": "false",
        **(extra_env or {}),
    }
    env.pop("DJANGO_DEBUG", None)
    s = RealStack(state, port, env, nodes=nodes)
    try:
        argvs = processes(state, nodes, port)
        if os.geteuid() == 0:
            # run by root (a CI box, a container): the agents run the bench's
            # jobs as root, as bench/agent_cost.py's do, where `make up` would
            # create a demo account
            for node in nodes:
                argvs[node.name].append("--allow-root-jobs")
        web = s.start("web", argvs.pop("web"))
        web.wait_for(r"Uvicorn running on|Application startup complete")
        for name in ("worker", "notifier"):
            s.start(name, argvs.pop(name)).wait_for(r"\bready\.")
        s.start("beat", argvs.pop("beat")).wait_for(r"beat: Starting")
        for name, argv in argvs.items():
            s.start(name, argv)
        for name in argvs:
            s.procs[name].wait_for(r"connected to ws://")
        want = sum(n.spec and int(n.spec.split("x")[0]) for n in nodes)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            up = Node.objects.filter(status="up").count()
            gpus = Gpu.objects.filter(present=True).count()
            if up == len(nodes) and gpus >= want:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"nodes not up: {up}/{len(nodes)}, {gpus} GPUs")
        connections.close_all()
        yield s
    finally:
        s.stop()


def is_root() -> bool:
    """Whether this runs as root, which the interactive benches need: they create
    the Unix account JupyterLab and terminals run as (an agent runs no job as
    root). Says so when it does not."""
    if os.geteuid() == 0:
        return True
    print("run as root: it creates the Unix account JupyterLab runs as")
    return False


@contextlib.contextmanager
def signed_in(base_url: str, user: str, password: str) -> Iterator[httpx.Client]:
    """A client holding ``user``'s session, signed in through the login form."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        client.get("/accounts/login/")
        resp = client.post(
            "/accounts/login/",
            data={
                "username": user,
                "password": password,
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
            },
        )
        if resp.status_code != 302:
            raise RuntimeError(f"login {user}: {resp.status_code}")
        yield client


@dataclass
class InteractiveStack:
    """``real_stack`` for interactive jobs: the stack, the Unix account its jobs
    run as with a working directory it owns, and a client with the bench's API
    token."""

    stack: RealStack
    account: pwd.struct_passwd
    workdir: Path
    token: str
    api: httpx.Client


@contextlib.contextmanager
def interactive_stack(
    label: str,
    cluster: str,
    make_users: Callable[[str], str],
    extra_env: dict[str, str] | None = None,
) -> Iterator[InteractiveStack]:
    """A Unix account of its own (``tests.interactive.accounts``: never root)
    with a working directory, a fresh database whose users ``make_users(account
    name)`` creates (it returns the API token the bench submits with), and
    ``real_stack`` on it, the agents finding this venv's ``jupyter`` on their
    PATH and binding it to loopback; ``extra_env`` adds settings. Run as root."""
    sys.path.insert(0, str(ROOT))
    from tests.interactive.accounts import jupyter_account, workdir_for

    bin_dir = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "GPULAB_JUPYTER_HOST": "127.0.0.1",
        **(extra_env or {}),
    }
    with (
        jupyter_account() as account,
        workdir_for(account) as workdir,
        tempfile.TemporaryDirectory(prefix=f"gpl-{label}-") as tmp,
        fresh_database(label) as db_url,
    ):
        token = make_users(account.pw_name)
        with (
            real_stack(db_url, Path(tmp), cluster, env) as stack,
            httpx.Client(
                base_url=stack.base_url,
                headers={"Authorization": f"Bearer {token}"},
                timeout=60,
            ) as api,
        ):
            yield InteractiveStack(stack, account, workdir, token, api)
