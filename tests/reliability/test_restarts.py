"""Redis and PostgreSQL restarted under a running portal: web, worker, beat and the
agent recover by themselves, no job exit is lost (the agent's spool replays it)
or stored twice, and requests made meanwhile fail cleanly (a 503, never a
traceback) or succeed without the broker, and the dashboards open in a browser
meanwhile show new readings again without a reload.

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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import redis as redis_lib

from portal.stack.embedded import (
    EmbeddedPostgres,
    EmbeddedRedis,
    start_postgres,
    start_redis,
)
from portal.stack.urls import celery_broker_url
from tests.browser import chromium, collect_errors, log_in
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


# The node page's utilisation chart: how many points its first trace has.
CHART_POINTS = "document.getElementById('chart-util').data[0].x.length"
TILE_APPLIED_AFTER = (
    "([sel, t]) => Number(document.querySelector(sel).dataset.appliedAt) > t"
)


def test_open_dashboards_show_new_readings_after_a_redis_restart(p: Private) -> None:
    """Redis keeps no data: a restart loses the browsers' Channels group
    memberships, the watch set and the published cluster state. Open pages must
    show new readings again by themselves, never reloaded: after a real restart
    (their sockets may close: they reconnect), and after the data is lost under
    connections that stay open (a restart quicker than the clients' retries:
    the sockets stay up and only the server side can notice)."""
    from playwright.sync_api import expect

    node_id = int(
        p.sql("SELECT id FROM scheduler_node WHERE name = 'private-node'")[0][0]
    )
    base = p.stack.base_url
    tile = f'[data-gpu="{node_id}:0"]'
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        log_in(context.new_page(), base, ADMIN, PASSWORD)
        node_page, cluster_page = context.new_page(), context.new_page()
        errors = (collect_errors(node_page), collect_errors(cluster_page))
        sockets = {"node": 0, "cluster": 0}  # websockets each page opened

        def count(name: str) -> Any:
            return lambda _ws: sockets.__setitem__(name, sockets[name] + 1)

        node_page.on("websocket", count("node"))
        cluster_page.on("websocket", count("cluster"))
        node_page.goto(f"{base}/nodes/{node_id}/")
        cluster_page.goto(f"{base}/")
        for page in (node_page, cluster_page):
            expect(page.locator("#live-status")).to_have_text("live", timeout=60_000)
            page.evaluate("window.__loaded = 'the first load'")

        def new_readings(since: float, timeout_ms: int) -> None:
            """Three more points on the node page's chart, and a cluster message
            drawn into the GPU's tile after ``since``."""
            points = node_page.evaluate(CHART_POINTS)
            node_page.wait_for_function(
                f"{CHART_POINTS} >= {points + 3}", timeout=timeout_ms
            )
            cluster_page.wait_for_function(
                TILE_APPLIED_AFTER, arg=[tile, since], timeout=timeout_ms
            )

        new_readings(0, 60_000)  # live before anything happens

        # 1. A real restart (stop, start): the server's consumers may fail and
        # close the sockets; the pages reconnect, resubscribe and catch up.
        p.redis.stop()
        p.redis = start_redis(p.state)
        new_readings(time.time(), 60_000)
        reconnects = dict(sockets)

        # 2. The same loss under connections that stay open: the dashboards'
        # Redis data (Channels groups and queues, the live keys) gone at once.
        # Within one rejoin period (10 s) or the hub noticing the loss.
        lost_at = time.time()
        with redis_lib.Redis.from_url(p.redis.url) as client:
            keys = [
                *client.scan_iter(match="glr:asgi*", count=1000),
                *client.scan_iter(match="glr:live:*", count=1000),
            ]
            assert keys
            client.delete(*keys)
        new_readings(lost_at, 30_000)
        assert sockets == reconnects, "a page reconnected: the loss went unnoticed"

        expect(cluster_page.locator(f'{tile} [data-f="util"]')).not_to_have_text(
            "\u2013"
        )
        for page in (node_page, cluster_page):
            assert page.evaluate("window.__loaded") == "the first load"
            expect(page.locator("#live-status")).to_have_text("live")
        assert errors == ([], [])
        print(f"\n[redis restart] websockets opened per page: {sockets}")  # noqa: T201
    p.all_running()


@pytest.fixture
def p(private: Private) -> Private:
    return private
