"""Live dashboards at scale: page render times with a big history, and
the latency from an agent's sample to a subscribed browser's websocket.

1. **Pages.** A fresh database with a 64-GPU lab's history, built by
   ``bench/admin_overview.py``'s ``populate`` (100,000 jobs over 30 days, each with
   its attempt, allocations and usage record; a minute rollup per GPU per minute and
   the hourly ones), plus 7 days of raw samples every 10 s per GPU (the raw
   retention: 3.9 million rows), every GPU's latest reading, 2,000 waiting jobs with
   their place and reason, 20 held ones, and 400 output chunks of one running job.
   Then ``GET /``, ``/queue/`` and ``/jobs/<running>/`` through Django's test client
   (middleware, views, templates; a staff user, who sees everything), ``--renders``
   times each after warm-up: p50 / p95, the queries, the three slowest queries, and a
   cProfile of one render (the top functions by cumulative time).
2. **Live.** The same database plus ``--nodes`` (50) nodes of 8 GPUs. The real ASGI
   server (uvicorn, channels_redis on Redis, PostgreSQL) is started; each node is a
   websocket client speaking the agent protocol with ``agents.protocol``'s models
   (hello, then a metrics frame every second, at a random phase, with its own
   ``sampled_at``; acks read). Browsers: one websocket subscribed to ``cluster``, others
   subscribed to 16 nodes each (session cookie, Origin header, as a page).
   Over ``--seconds`` (after ``--warmup``) every update's latency is its receipt
   time minus the sample time it carries (same machine, same clock): node updates
   (``node.metrics``) and the cluster's deltas (each GPU entry's reading time), p50 /
   p99, the number of cluster messages per second, and the server's CPU.

Prints the figures and writes ``<out-dir>/live_dashboard.json``. Run through
``make bench``, or ``python -m portal.stack.run -- python bench/live_dashboard.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import itertools
import json
import os
import pstats
import random
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from admin_overview import populate as populate_history
from agent_cost import cpu_seconds
from pass_scaling import _admin_conninfo, _with_db, setup_django

ROOT = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ------------------------------------------------------------------ data


def populate_pages() -> dict[str, Any]:
    """What the pages show on top of the 30-day history (see the docstring)."""
    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone

    from scheduler import metrics
    from scheduler.models import Attempt, Job, JobLogChunk

    now = timezone.now()
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, now)
        cursor.execute(
            """
            INSERT INTO scheduler_gpusample (gpu_id, at, util_gpu, util_mem,
                memory_used_mib, temperature_c, power_w, lost, processes)
            SELECT g.id, t, abs(hashtext(g.id::text || t::text)) %% 100, 30,
                   20000, 60, 250, false, '[]'::jsonb
            FROM scheduler_gpu g,
                 generate_series(date_trunc('minute', %(since)s::timestamptz),
                                 %(now)s::timestamptz, interval '10 seconds') t
            """,
            {"since": now - timezone.timedelta(days=7), "now": now},
        )
        # The running jobs' processes in the last hour, and every GPU's latest.
        cursor.execute(
            """
            UPDATE scheduler_gpusample s SET processes = jsonb_build_array(
                jsonb_build_object('pid', 1000 + a.gpu_id, 'used_memory_mib', 20000,
                                   'attempt_id', a.attempt_id))
            FROM scheduler_allocation a
            WHERE a.gpu_id = s.gpu_id AND a.slot = 0 AND a.released_at IS NULL
              AND s.at > %s
            """,
            [now - timezone.timedelta(hours=1)],
        )
        cursor.execute(
            """
            UPDATE scheduler_gpu g SET latest_at = %s, latest = jsonb_build_object(
                'util_gpu', 50 + g.index * 6, 'memory_used_mib', 20000,
                'temperature_c', 61, 'power_w', 280, 'processes',
                COALESCE((SELECT jsonb_agg(jsonb_build_object(
                    'pid', 1000 + a.gpu_id, 'used_memory_mib', 20000,
                    'attempt_id', a.attempt_id))
                  FROM scheduler_allocation a
                  WHERE a.gpu_id = g.id AND a.slot = 0 AND a.released_at IS NULL),
                  '[]'::jsonb))
            """,
            [now],
        )
    users = list(User.objects.order_by("id")[:40])
    groups = [u.lab_groups.first() for u in users]
    Job.objects.bulk_create(
        Job(
            owner=users[i % 40],
            group=groups[i % 40],
            name=f"waiting-{i}",
            command="train",
            workdir="/tmp",
            gpus=1 + i % 4,
            time_limit_s=86400,
            status=Job.Status.HELD if i < 20 else Job.Status.PENDING,
            submitted_at=now - timezone.timedelta(minutes=i),
            queue_order=None if i < 20 else i - 19,
            pending_message="" if i < 20 else "waiting for GPUs: 0 of 64 free",
            priority_breakdown={"class": 500.0, "age": float(i), "fairshare": 300.0},
        )
        for i in range(2020)
    )
    attempt = Attempt.objects.filter(ended_at__isnull=True).order_by("id").first()
    assert attempt is not None
    JobLogChunk.objects.bulk_create(
        JobLogChunk(
            attempt=attempt,
            node_id=attempt.node_id,
            offset=i * 100,
            data=f"step {i} loss {1 / (i + 1):.4f}\n" * 4,
        )
        for i in range(400)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    staff = User.objects.create_user(
        "bench-admin", password="bench-pw-1", is_staff=True
    )
    return {"job": attempt.job_id, "staff": staff.pk}


# ------------------------------------------------------------------ pages


def measure_pages(job_id: int, staff_id: int, renders: int) -> dict[str, Any]:
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client

    client = Client(HTTP_HOST="localhost")  # an allowed host, as a browser's
    client.force_login(User.objects.get(pk=staff_id))
    out: dict[str, Any] = {}
    for name, url in (
        ("cluster", "/"),
        ("queue", "/queue/"),
        ("job", f"/jobs/{job_id}/"),
    ):
        for _ in range(3):
            assert client.get(url).status_code == 200
        times = []
        for _ in range(renders):
            t0 = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - t0) * 1000)
            assert response.status_code == 200
        captured: list[tuple[float, str]] = []

        def timed(execute: Any, sql: str, params: Any, many: Any, ctx: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return execute(sql, params, many, ctx)
            finally:
                captured.append(((time.perf_counter() - t0) * 1000, sql))

        with connection.execute_wrapper(timed):
            client.get(url)
        slowest = sorted(captured, reverse=True)[:3]
        profile = cProfile.Profile()
        profile.enable()
        client.get(url)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        out[name] = {
            "url": url,
            "p50_ms": round(pct(times, 50) or 0, 1),
            "p95_ms": round(pct(times, 95) or 0, 1),
            "renders": renders,
            "queries": len(captured),
            "slowest_queries": [
                {"ms": round(ms, 1), "sql": " ".join(sql.split())[:300]}
                for ms, sql in slowest
            ],
            "profile_top": _profile_lines(text.getvalue()),
        }
    return out


def _profile_lines(text: str, keep: int = 12) -> list[str]:
    """The top project functions of a cProfile listing (cumulative time)."""
    lines = []
    for line in text.splitlines():
        if re.search(r"(portal|scheduler|django/template|django/db)/", line):
            lines.append(" ".join(line.split()))
        if len(lines) >= keep:
            break
    return lines


# ------------------------------------------------------------------ live


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_nodes(count: int) -> tuple[list[dict[str, Any]], str]:
    """``count`` registered nodes (tokens) and a signed-in session for a browser."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    from scheduler import services

    nodes = []
    for i in range(count):
        node, token = services.create_node(f"live-{i:02d}")
        nodes.append({"id": node.pk, "name": node.name, "token": token})
    client = Client()
    client.force_login(User.objects.get(username="bench-admin"))
    return nodes, client.cookies[settings.SESSION_COOKIE_NAME].value


class AgentTrace:
    """What one simulated agent sent and got back (``bench/ingest.py``): each
    metrics frame's seq -> (sample time, monotonic send time), each ack's seq ->
    monotonic receipt time, and the errors the server replied or the link raised."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[float, float]] = {}
        self.acks: dict[int, float] = {}
        self.errors: list[str] = []

    def received(self, raw: str | bytes) -> None:
        msg = json.loads(raw)
        kind = msg.get("type")
        if kind == "ack":
            self.acks[msg["data"]["seq"]] = time.monotonic()
        elif kind == "error":
            self.errors.append(str(msg.get("data"))[:200])


async def run_agent(
    url: str,
    node: dict[str, Any],
    stop: asyncio.Event,
    sent: list[int],
    *,
    trace: AgentTrace | None = None,
    connect_delay: float = 0.0,
    drain_s: float = 0.0,
) -> None:
    """One node's agent: hello, then a metrics frame a second at a random phase
    until ``stop``. With a ``trace``, what it sent and the acks are recorded and,
    after ``stop``, it waits up to ``drain_s`` for the acks still due."""
    from websockets.asyncio.client import connect

    from agents import protocol

    gpus = [
        protocol.GpuInfo(
            index=i,
            uuid=f"GPU-{node['name']}-{i}",
            name="NVIDIA A100-80GB",
            memory_total_mib=81920,
        )
        for i in range(8)
    ]
    await asyncio.sleep(connect_delay)
    async with connect(
        f"{url}/ws/agent/",
        additional_headers=[("Authorization", f"Bearer {node['token']}")],
        max_size=None,
        compression=protocol.WS_COMPRESSION,  # as the agent connects
    ) as ws:

        async def drain() -> None:
            with contextlib.suppress(Exception):
                async for raw in ws:
                    if trace is not None:
                        trace.received(raw)

        reader = asyncio.create_task(drain())
        seq = 1
        hello = protocol.HelloData(
            agent_version="bench",
            hostname=node["name"],
            incarnation=uuid.uuid4().hex,
            driver_version="550",
            cuda_version="12.4",
            gpus=gpus,
        )
        await ws.send(
            protocol.Hello(seq=seq, ts=time.time(), data=hello).model_dump_json()
        )
        await asyncio.sleep(random.random())  # a random phase in the second
        next_at = time.monotonic()
        while not stop.is_set():
            seq += 1
            now = time.time()
            data = protocol.MetricsData(
                sampled_at=now,
                gpus=[
                    protocol.GpuSample(
                        index=g.index,
                        uuid=g.uuid,
                        util_gpu=float(random.randint(0, 100)),
                        memory_used_mib=random.randint(1000, 80000),
                        memory_total_mib=81920,
                        temperature_c=float(random.randint(30, 85)),
                        power_w=float(random.randint(50, 400)),
                        processes=[protocol.ProcessSample(pid=100, used_memory_mib=512)]
                        if g.index == 0
                        else [],
                    )
                    for g in gpus
                ],
            )
            await ws.send(
                protocol.Metrics(seq=seq, ts=now, data=data).model_dump_json()
            )
            if trace is not None:
                trace.sent[seq] = (now, time.monotonic())
            sent[0] += 1
            next_at += 1.0
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        deadline = time.monotonic() + drain_s
        while (
            trace is not None
            and len(trace.acks) < len(trace.sent)
            and time.monotonic() < deadline
            and not reader.done()
        ):
            await asyncio.sleep(0.2)
        reader.cancel()


async def run_browser(
    url: str,
    cookie: str,
    subscriptions: list[dict[str, Any]],
    stop: asyncio.Event,
    record: dict[str, list[float]],
    measuring: asyncio.Event,
) -> None:
    from django.conf import settings
    from websockets.asyncio.client import connect

    async with connect(
        f"{url}/ws/dashboard/",
        additional_headers=[
            ("Cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}"),
            ("Origin", url.replace("ws://", "http://")),
        ],
        max_size=None,
    ) as ws:
        for sub in subscriptions:
            await ws.send(json.dumps(sub))
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), 1.0)
            except TimeoutError:
                continue
            now = time.time()
            if not measuring.is_set():
                continue
            msg = json.loads(raw)
            kind = msg.get("type")
            if kind == "node.metrics":
                record["node"].append(now - msg["at"])
            elif kind == "cluster.delta":
                record["cluster_messages"].append(now)
                record["cluster_bytes"].append(len(raw))
                for gpu in msg["gpus"]:
                    if gpu["at"] is not None and gpu["key"].split(":")[0] in LIVE_IDS:
                        record["cluster"].append(now - gpu["at"])


LIVE_IDS: set[str] = set()


async def measure_live(
    port: int, nodes: list[dict[str, Any]], cookie: str, warmup: float, seconds: float
) -> dict[str, Any]:
    url = f"ws://127.0.0.1:{port}"
    LIVE_IDS.update(str(n["id"]) for n in nodes)
    stop, measuring = asyncio.Event(), asyncio.Event()
    record: dict[str, list[float]] = {
        "node": [],
        "cluster": [],
        "cluster_messages": [],
        "cluster_bytes": [],
    }
    sent = [0]
    # One tab on the cluster page; the nodes' pages in tabs of 16 (a tab's
    # message budget is 20 at once).
    browsers: list[list[dict[str, Any]]] = [[{"subscribe": "cluster"}]]
    for first in range(0, len(nodes), 16):
        browsers.append(
            [{"subscribe": "node", "id": n["id"]} for n in nodes[first : first + 16]]
        )
    tasks = [
        asyncio.create_task(run_browser(url, cookie, subs, stop, record, measuring))
        for subs in browsers
    ]
    tasks += [asyncio.create_task(run_agent(url, n, stop, sent)) for n in nodes]
    await asyncio.sleep(warmup)
    measuring.set()
    frames0 = sent[0]
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - t0
    frames = sent[0] - frames0
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    msgs = record["cluster_messages"]
    gaps = [b - a for a, b in itertools.pairwise(msgs)]
    return {
        "nodes": len(nodes),
        "gpus": 8 * len(nodes),
        "seconds": round(elapsed, 1),
        "metrics_frames_per_s": round(frames / elapsed, 1),
        "node_updates": len(record["node"]),
        "node_p50_ms": _ms(pct(record["node"], 50)),
        "node_p99_ms": _ms(pct(record["node"], 99)),
        "node_max_ms": _ms(max(record["node"], default=None)),
        "cluster_readings": len(record["cluster"]),
        "cluster_p50_ms": _ms(pct(record["cluster"], 50)),
        "cluster_p99_ms": _ms(pct(record["cluster"], 99)),
        "cluster_messages_per_s": round(len(msgs) / elapsed, 2),
        "cluster_min_gap_ms": _ms(min(gaps, default=None)),
        "cluster_message_kib_p50": round(
            (pct(record["cluster_bytes"], 50) or 0) / 1024, 1
        ),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def start_server(
    db_url: str, port: int, log: Path | None = None
) -> subprocess.Popen[str]:
    """The web process on ``port``; its output to ``log`` when given (a pipe
    nobody reads would stall a server that logs much), else a pipe."""
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "DJANGO_SECURE_COOKIES": "false",
        "PYTHONUNBUFFERED": "1",
        "GPULAB_LOG_LEVEL": "WARNING",
    }
    env.pop("DJANGO_DEBUG", None)
    from portal.stack.up import processes

    # The web process exactly as `make up` runs it, quieter.
    argv = processes(ROOT / "var", [], port)["web"] + ["--log-level", "warning"]
    out = log.open("a") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), 1),
        ):
            return proc
        if proc.poll() is not None:
            raise RuntimeError(
                "uvicorn exited:\n"
                + (
                    proc.stdout.read()
                    if proc.stdout
                    else log.read_text()
                    if log
                    else ""
                )
            )
        time.sleep(0.2)
    raise RuntimeError("uvicorn did not start listening within 60 s")


# ------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--renders", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    name = f"bench_live_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    server = None
    result: dict[str, Any] = {"load_before": os.getloadavg()}
    try:
        db_url = _with_db(url, name)
        setup_django(db_url)
        t0 = time.perf_counter()
        populate_history(args.jobs)
        made = populate_pages()
        print(f"populated {args.jobs} jobs, 64 GPUs x 30 days of rollups, 7 days of "
              f"raw samples in {time.perf_counter() - t0:.0f} s")  # fmt: skip
        result["pages"] = measure_pages(made["job"], made["staff"], args.renders)
        for page, figures in result["pages"].items():
            print(f"{page:8} p50 {figures['p50_ms']:7.1f} ms  p95 {figures['p95_ms']:7.1f}"
                  f" ms  {figures['queries']} queries; slowest "
                  f"{figures['slowest_queries'][0]['ms']} ms")  # fmt: skip

        nodes, cookie = make_nodes(args.nodes)
        from django.db import connections

        connections.close_all()
        port = free_port()
        server = start_server(db_url, port)
        cpu0, w0 = cpu_seconds(server.pid) or 0.0, time.monotonic()
        result["live"] = asyncio.run(
            measure_live(port, nodes, cookie, args.warmup, args.seconds)
        )
        cpu1, w1 = cpu_seconds(server.pid) or 0.0, time.monotonic()
        result["live"]["server_cpu_pct_of_one_core"] = round(
            100 * (cpu1 - cpu0) / (w1 - w0), 1
        )
        result["load_after"] = os.getloadavg()
        live = result["live"]
        print(f"live: {live['nodes']} nodes ({live['gpus']} GPUs), "
              f"{live['metrics_frames_per_s']} frames/s for {live['seconds']} s; "
              f"server CPU {live['server_cpu_pct_of_one_core']} % of a core")  # fmt: skip
        print(f"  node updates    p50 {live['node_p50_ms']} ms  p99 {live['node_p99_ms']}"
              f" ms  ({live['node_updates']} updates)")  # fmt: skip
        print(f"  cluster deltas  p50 {live['cluster_p50_ms']} ms  p99 "
              f"{live['cluster_p99_ms']} ms  ({live['cluster_messages_per_s']} "
              f"messages/s, closest two {live['cluster_min_gap_ms']} ms apart, "
              f"{live['cluster_message_kib_p50']} KiB each)")  # fmt: skip
        print(
            f"load average before {result['load_before']}, after {result['load_after']}"
        )
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "live_dashboard.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if server is not None:
            server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(15)
        from django.db import connections

        connections.close_all()
        with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
