"""The portal's real processes for benchmarks, as ``make up`` runs them.

A fresh database (created, migrated, dropped at the end), then web (uvicorn),
worker, notifier, beat and one simulated agent per node with the very argv
``portal.stack.up.processes`` gives ``make up``. Each process's output is kept
line by line with the time it was read, so a bench can wait for a line and read
the processes' own log timestamps (every process logs ``%(asctime)s``; they run
with ``TZ=UTC`` on this machine's one clock).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_scaling import _admin_conninfo, _with_db, setup_django

if TYPE_CHECKING:
    from collections.abc import Iterator

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
