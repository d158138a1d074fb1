"""Real processes for end-to-end tests: the ASGI server, a Celery worker and agents.

They run against this run's PostgreSQL test database (``transactional_db``, so their
writes and ours are visible to each other) and this run's Redis prefix (inherited
through ``GPULAB_REDIS_PREFIX``). Readiness is awaited on the processes' own log
lines, never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from portal.stack.up import web_argv

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def database_url() -> str:
    """The URL of the test database this run's tests use (host may be a socket dir)."""
    from django.db import connection

    s = connection.settings_dict
    auth = quote(s["USER"] or "postgres")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"])
    host = s.get("HOST") or ""
    name = quote(s["NAME"])
    if host.startswith("/"):
        return f"postgresql://{auth}@/{name}?host={quote(host)}"
    port = f":{s['PORT']}" if s.get("PORT") else ""
    return f"postgresql://{auth}@{host}{port}/{name}"


@dataclass
class Proc:
    """A child process whose combined output is collected line by line, so tests
    can wait for a line to appear (an event) instead of sleeping."""

    name: str
    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def start_reader(self) -> None:
        def pump() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                with self.cond:
                    self.lines.append(line.rstrip("\n"))
                    self.cond.notify_all()
            with self.cond:
                self.cond.notify_all()

        threading.Thread(target=pump, name=f"log-{self.name}", daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 60.0, start: int = 0) -> str:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            seen = start
            while True:
                for line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.lines)
                if self.popen.poll() is not None:
                    raise AssertionError(
                        f"{self.name} exited ({self.popen.returncode}) before "
                        f"{pattern!r}:\n" + self.output()
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"{self.name}: no {pattern!r} within {timeout}s:\n"
                        + self.output()
                    )
                self.cond.wait(remaining)

    def output(self, last: int = 60) -> str:
        with self.cond:
            return "\n".join(self.lines[-last:])

    def stop(self, timeout: float = 15.0) -> None:
        stop_all([self], timeout)


def stop_all(procs: list[Proc], timeout: float = 15.0) -> None:
    """SIGTERM to every process at once, then wait for each (SIGKILL to those
    still running after ``timeout``): their shutdowns overlap instead of adding up."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(5)


@dataclass
class Stack:
    """The running portal: base URL, its processes, and helpers."""

    base_url: str
    port: int
    env: dict[str, str]
    procs: dict[str, Proc]
    tmp: Path

    def start(
        self, name: str, *args: str, extra_env: dict[str, str] | None = None
    ) -> Proc:
        env = {**self.env, **(extra_env or {})}
        popen = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        proc = Proc(name, popen)
        proc.start_reader()
        self.procs[name] = proc
        return proc

    def start_web(self, name: str = "web", **extra_env: str) -> Proc:
        return self.start(name, *web_argv(self.port), extra_env=extra_env)

    def restart_web(self, name: str, **extra_env: str) -> Proc:
        """Stop the web process and start one with ``extra_env``, listening."""
        self.procs["web"].stop()
        web = self.start_web(name, **extra_env)
        web.wait_for(r"Uvicorn running on")
        return web

    def start_notifier(self) -> Proc:
        """The worker of the notifications queue (as ``make up``'s notifier)."""
        proc = self.start(
            "notifier",
            sys.executable, "-m", "celery", "-A", "portal", "worker",
            "--loglevel", "INFO", "--concurrency", "1", "--pool", "solo",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--hostname", "notifier@%h",
            "-Q", f"{self.env['GPULAB_REDIS_PREFIX']}.notifications",
        )  # fmt: skip
        proc.wait_for(r"\bready\.")
        return proc

    def start_agent(
        self, node: str, token: str, spec: str = "2xA100-80GB", *extra: str
    ) -> Proc:
        state = self.tmp / f"agent-{node}"
        state.mkdir(exist_ok=True)
        token_file = state / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        return self.start(
            f"agent-{node}",
            sys.executable,
            "-m",
            "agents",
            "--server",
            f"ws://127.0.0.1:{self.port}",
            "--token-file",
            str(token_file),
            "--simulate",
            spec,
            "--state-dir",
            str(state),
            "--heartbeat",
            "1",
            "--backoff-base",
            "0.2",
            "--backoff-cap",
            "1",
            # Simulated GPU uuids derive from the host name: one per node.
            "--hostname",
            node,
            *(["--allow-root-jobs"] if os.geteuid() == 0 else []),
            *extra,
        )

    def start_node(self, name: str, spec: str, gpus: int) -> tuple[Any, Proc]:
        """Register a node, start its simulated agent, and return once the agent is
        connected and the node is UP with its ``gpus`` GPUs."""
        from scheduler import services
        from scheduler.models import Node

        node, token = services.create_node(name)
        agent = self.start_agent(name, token, spec)
        agent.wait_for(r"connected to ws://")
        wait_until(
            lambda: (
                Node.objects.filter(pk=node.pk, status="up").exists()
                and node.gpus.count() == gpus
            ),
            what=f"the hello of {name}",
        )
        return node, agent


@pytest.fixture
def stack(
    transactional_db: None, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    """The ASGI server (uvicorn) and a Celery worker on this run's test database.

    A test marked ``@pytest.mark.web_env(NAME="value", ...)`` gets its web process
    started with those variables added: one process, where a ``restart_web`` at
    the test's start would start and stop another first. One marked
    ``@pytest.mark.web_only`` (no job runs: sign-ins, the API's limits) gets no
    worker, a Django process less to start; the tasks its web process queued
    are removed at its end, so the next test's worker never runs them."""
    marker = request.node.get_closest_marker("web_env")
    web_env = {k: str(v) for k, v in marker.kwargs.items()} if marker else {}
    web_only = request.node.get_closest_marker("web_only") is not None
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "PYTHONUNBUFFERED": "1",
        "GPULAB_SCHEDULE_INTERVAL": "5",
        # Plain HTTP on loopback: cookies must not be Secure-only.
        "DJANGO_SECURE_COOKIES": "false",
        # Some tests wait on the worker's line for each task it ran.
        "GPULAB_TASK_LOG_LEVEL": "INFO",
    }
    env.pop("DJANGO_DEBUG", None)
    s = Stack(f"http://127.0.0.1:{port}", port, env, {}, tmp_path)
    try:
        web = s.start_web(**web_env)
        if not web_only:
            s.start(
                "worker",
                sys.executable, "-m", "celery", "-A", "portal", "worker",
                "--loglevel", "INFO", "--concurrency", "1", "--pool", "solo",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            )  # fmt: skip
        web.wait_for(r"Uvicorn running on")
        if not web_only:
            s.procs["worker"].wait_for(r"\bready\.")
        yield s
    finally:
        stop_all(list(s.procs.values()))
        if web_only:
            from tests.capture import Broker

            broker = Broker()
            broker.purge()
            broker.close()
        # The worker and server hold connections to the test database: they are
        # gone now, so pytest-django can flush it.
        kill_leftover_jobs(tmp_path)


def kill_leftover_jobs(root: Path) -> None:
    """Kill the jobs the test's agents left running (a test that failed half-way):
    each runs under a shim in its own session that outlives its agent by design,
    so stopping the agents leaves them, and a job waiting on a gate file would
    loop for ever. Their process groups are the shims' and the ones recorded in
    each job directory's ``pgid``."""
    marker = str(root)
    groups: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "agents.shim" in cmdline and marker in cmdline:
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(int(proc.name)))
    for pgid_file in root.glob("**/jobs/*/pgid"):
        with contextlib.suppress(OSError, ValueError):
            groups.add(int(pgid_file.read_text().split()[0]))
    for pgid in groups:
        if pgid > 1 and pgid != os.getpgrp():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def login(base_url: str, username: str, password: str) -> httpx.Client:
    """An HTTP client logged in through the real login form."""
    client = httpx.Client(base_url=base_url, follow_redirects=False, timeout=30)
    page = client.get("/accounts/login/")
    assert page.status_code == 200, page.text
    token = client.cookies["csrftoken"]
    resp = client.post(
        "/accounts/login/",
        data={"username": username, "password": password, "csrfmiddlewaretoken": token},
    )
    assert resp.status_code == 302, f"login failed: {resp.status_code}"
    return client


def csrf_post(client: httpx.Client, path: str, data: dict[str, Any]) -> httpx.Response:
    return client.post(
        path, data={**data, "csrfmiddlewaretoken": client.cookies["csrftoken"]}
    )


def submit(client: httpx.Client, name: str, command: str, **fields: str) -> int:
    """Submit a one-GPU ``normal`` job through the web form (``fields`` add to or
    override the form's fields); its id, from the redirect to its page."""
    resp = csrf_post(
        client,
        "/jobs/new/",
        {
            "name": name,
            "command": command,
            "workdir": "/tmp",
            "gpus": "1",
            "priority_class": "normal",
            **fields,
        },
    )
    assert resp.status_code == 302, resp.text
    match = re.fullmatch(r"/jobs/(\d+)/", resp.headers["location"])
    assert match, resp.headers["location"]
    return int(match.group(1))


def submit_in_browser(page: Any, base: str, name: str, command: str) -> int:
    """``submit`` as a person does it: the Submit page's form in a signed-in
    Playwright page, one GPU in /tmp; the job's id, from the page it lands on."""
    page.goto(f"{base}/jobs/new/")
    page.fill("#id_name", name)
    page.fill("#id_command", command)
    page.fill("#id_workdir", "/tmp")
    page.fill("#id_gpus", "1")
    page.click("main button[type=submit]")
    page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
    match = re.search(r"/jobs/(\d+)/$", page.url)
    assert match, page.url
    return int(match.group(1))


def wait_for_job(job_id: int, wanted: set[str], timeout: float = 60.0) -> str:
    """Wait until the job's status is one of ``wanted``.

    Subscribes to the job's Channels group (the same events the dashboards get),
    then checks the database after every event: no polling interval, no sleep.
    """
    from scheduler.events import job_group
    from scheduler.models import Job

    @database_sync_to_async
    def status() -> str:
        return str(Job.objects.values_list("status", flat=True).get(pk=job_id))

    async def waiter() -> str:
        layer = get_channel_layer()
        assert layer is not None
        channel = await layer.new_channel()
        await layer.group_add(job_group(job_id), channel)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                current = await status()
                if current in wanted:
                    return current
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise AssertionError(
                        f"job {job_id} still {current!r}, wanted one of {wanted}"
                    )
                # Re-check the database at least every 5 s: an event may predate
                # the group_add.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(layer.receive(channel), min(remaining, 5))
        finally:
            await layer.group_discard(job_group(job_id), channel)

    return async_to_sync(waiter)()


def wait_until(check: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """For conditions no process announces (a file appearing): a bounded poll."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def bearer(secret: str) -> dict[str, str]:
    """The headers of an API call with token ``secret``."""
    return {"Authorization": f"Bearer {secret}"}


def new_bearer(user: Any, name: str) -> dict[str, str]:
    """``bearer`` of a new token of ``user`` (one client to the web gate)."""
    from portal.api.tokens import create_token

    return bearer(create_token(user, name, None)[1])


@dataclass
class HeldCall:
    """An API call kept running in the web process (``hold_a_call``)."""

    secret: str  # its token's: another call with it is the same client
    lock: Any  # the psycopg connection holding the token's row
    call: threading.Thread

    @property
    def headers(self) -> dict[str, str]:
        """Another call as the same client."""
        return bearer(self.secret)

    def release(self) -> None:
        """End the lock's transaction: the call finishes and gives up its place."""
        self.lock.commit()
        self.call.join(timeout=60)
        self.lock.close()


def hold_a_call(url: str, user: Any, name: str) -> HeldCall:
    """Start, in a thread, a GET of ``url`` with a new token of ``user`` that stays
    running in the web process until ``release``: the token's first use stamps
    ``last_used_at``, and this holds that row ``FOR UPDATE``. Returns once the call
    waits on the lock, so it holds its place in the web process."""
    import psycopg

    from portal.api.models import ApiToken
    from portal.api.tokens import create_token

    token, secret = create_token(user, name, None)
    lock = psycopg.connect(database_url())
    lock.execute(
        f"SELECT 1 FROM {ApiToken._meta.db_table} WHERE id = %s FOR UPDATE",
        [token.pk],
    )
    call = threading.Thread(
        target=httpx.get,
        args=(url,),
        kwargs={"headers": bearer(secret), "timeout": 60},
    )
    call.start()
    pid = lock.info.backend_pid
    wait_until(
        lambda: lock.execute(
            "SELECT count(*) FROM pg_locks"
            " WHERE NOT granted AND %s = ANY(pg_blocking_pids(pid))",
            [pid],
        ).fetchone()[0],
        what="the API call waiting on the row lock",
    )
    return HeldCall(secret, lock, call)


def live_processes_in_group(pgid: int) -> list[int]:
    """PIDs of the process group's members that are not zombies."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces or parentheses.
        rest = text[text.rindex(")") + 2 :].split()
        state, pgrp = rest[0], int(rest[2])
        if pgrp == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members
