"""Redis and PostgreSQL restarted under a running portal: web, worker, beat and the
agent recover by themselves, no job exit is lost (the agent's spool replays it)
or stored twice, and requests made meanwhile fail cleanly (a 503, never a
traceback) or succeed without the broker.

These run against PRIVATE embedded servers (``portal.stack.embedded``) that this
module starts, migrates and restarts: never the machine's shared PostgreSQL and
Redis, which other test runs use. One set of servers and processes for the
module; each test restarts one service and leaves it running."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from portal.stack.embedded import (
    EmbeddedPostgres,
    EmbeddedRedis,
    start_postgres,
    start_redis,
)
from portal.stack.urls import celery_broker_url
from tests.e2e.conftest import ROOT, Stack, free_port, login, submit, wait_until
from tests.reliability.processes import start_beat, start_worker

if TYPE_CHECKING:
    from collections.abc import Iterator

    import httpx

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ADMIN, PASSWORD = "ops", "restart-" + secrets.token_hex(8)


@dataclass
class Private:
    """The private servers, the portal's processes on them, a logged-in user."""

    state: Path
    postgres: EmbeddedPostgres
    redis: EmbeddedRedis
    stack: Stack
    client: httpx.Client

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """One query on a fresh connection (the server may have restarted)."""
        with psycopg.connect(self.postgres.url, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()

    def status(self, job_id: int) -> str:
        return str(
            self.sql("SELECT status FROM scheduler_job WHERE id = %s", job_id)[0][0]
        )

    def wait_status(self, job_id: int, wanted: set[str], timeout: float = 90) -> str:
        return str(
            wait_until(
                lambda: (s := self.status(job_id)) in wanted and s,
                timeout=timeout,
                what=f"job {job_id} in {wanted}",
            )
        )

    def events_to(self, job_id: int, status: str) -> int:
        rows = self.sql(
            "SELECT count(*) FROM scheduler_jobevent WHERE job_id = %s"
            " AND to_status = %s",
            job_id,
            status,
        )
        return int(rows[0][0])

    def all_running(self) -> None:
        for name, proc in self.stack.procs.items():
            assert proc.popen.poll() is None, f"{name} died:\n{proc.output()}"


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def private() -> Iterator[Private]:
    state = Path(tempfile.mkdtemp(prefix="glr-", dir="/tmp"))  # short socket paths
    postgres = start_postgres(state)
    redis = start_redis(state)
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": postgres.url,
        "REDIS_URL": redis.url,
        "CELERY_BROKER_URL": celery_broker_url(redis.url),
        "GPULAB_REDIS_PREFIX": "glr",
        "GPULAB_STATE_DIR": str(state),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "DJANGO_SECURE_COOKIES": "false",
        "DJANGO_SUPERUSER_USERNAME": ADMIN,
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        "PYTHONUNBUFFERED": "1",
        "GPULAB_SCHEDULE_INTERVAL": "1",
        "GPULAB_CHECK_NODES_INTERVAL": "1",
        # Restarts here are short: never long enough to lose the node.
        "GPULAB_NODE_LOST_AFTER": "120",
    }
    env.pop("DJANGO_DEBUG", None)
    stack = Stack(f"http://127.0.0.1:{port}", port, env, {}, state)
    client = None
    priv = None
    try:
        manage(env, "migrate", "--noinput", "-v0")
        manage(env, "ensure_admin")
        token_file = state / "node-token"
        manage(env, "create_node", "private-node", "--token-file", str(token_file))
        web = stack.start_web()
        start_worker(stack, "worker")
        start_beat(stack)
        web.wait_for(r"Uvicorn running on")
        agent = stack.start_agent(
            "private-node", token_file.read_text().strip(), "1xA100-80GB"
        )
        agent.wait_for(r"connected to ws://")
        client = login(stack.base_url, ADMIN, PASSWORD)
        priv = Private(state, postgres, redis, stack, client)
        yield priv
    finally:
        if client is not None:
            client.close()
        for proc in reversed(list(stack.procs.values())):
            proc.stop()
        # The servers running now: the tests replace the ones they restart.
        (priv.redis if priv else redis).stop()
        (priv.postgres if priv else postgres).stop()
        shutil.rmtree(state, ignore_errors=True)


def waiting_job(p: Private, name: str, exit_code: int) -> tuple[int, Path]:
    marker = p.state / f"{name}.go"
    job_id = submit(
        p.client,
        name,
        f"echo started; while [ ! -e {marker} ]; do sleep 0.1; done; exit {exit_code}",
    )
    assert p.wait_status(job_id, {"running"}) == "running"
    return job_id, marker


def test_a_redis_restart_loses_no_exit_and_everything_recovers(p: Private) -> None:
    job_id, marker = waiting_job(p, "through-redis", 3)

    p.redis.stop()  # no persistence: queues, channel groups and flags are gone
    marker.touch()  # the job ends while Redis is down
    # A submission meanwhile is stored (its pass trigger is logged, not fatal).
    during = submit(p.client, "submitted-while-down", "echo after")
    p.redis = start_redis(p.state)

    assert p.wait_status(job_id, {"failed", "completed"}) == "failed"
    assert p.sql("SELECT exit_code FROM scheduler_job WHERE id = %s", job_id) == [(3,)]
    assert p.events_to(job_id, "failed") == 1
    # A pass ran after recovery, and its launch reached the agent.
    assert p.wait_status(during, {"completed", "failed"}) == "completed"
    after = submit(p.client, "submitted-after", "echo after")
    assert p.wait_status(after, {"completed", "failed"}) == "completed"
    assert p.client.get("/jobs/").status_code == 200
    p.all_running()


def test_a_postgres_restart_fails_requests_cleanly_and_replays_the_exit(
    p: Private,
) -> None:
    job_id, marker = waiting_job(p, "through-postgres", 0)
    agent = p.stack.procs["agent-private-node"]
    seen = len(agent.lines)

    p.postgres.stop()
    page = p.client.get("/jobs/")
    api = p.client.get("/jobs/", headers={"Accept": "application/json"})
    post = p.client.post(
        "/jobs/new/",
        data={"name": "lost?", "command": "true", "gpus": "1",
              "csrfmiddlewaretoken": p.client.cookies["csrftoken"]},
    )  # fmt: skip
    marker.touch()  # the job ends while the database is down: its exit waits
    agent.wait_for(r"code[ =]1013", start=seen)  # told to try again later
    p.postgres = start_postgres(p.state)

    assert (page.status_code, page.headers["Retry-After"]) == (503, "5")
    assert "The database is unavailable; nothing was changed." in page.text
    assert "Traceback" not in page.text
    assert api.status_code == 503 and api.json()["error"] == "unavailable"
    assert post.status_code == 503
    assert p.wait_status(job_id, {"completed", "failed"}) == "completed"
    assert p.events_to(job_id, "completed") == 1
    assert p.sql("SELECT count(*) FROM scheduler_job WHERE name = 'lost?'") == [(0,)]
    after = submit(p.client, "after-postgres", "echo after")
    assert p.wait_status(after, {"completed", "failed"}) == "completed"
    assert p.client.get("/jobs/").status_code == 200
    p.all_running()


@pytest.fixture
def p(private: Private) -> Private:
    return private
