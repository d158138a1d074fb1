"""Telemetry ingest: the largest number of nodes the real web process
takes at 1 Hz with nothing lost and the dashboards under a second.

Input: ``--nodes`` (a list, e.g. ``50,100,200,400``) simulated nodes of 8 GPUs,
each a websocket client speaking the agent protocol with ``agents.protocol``'s
models (``live_dashboard.run_agent``: hello, then a metrics frame every second at
a random phase, its own ``sampled_at``), spread over ``--generators`` load-generator
processes; the web process exactly as ``make up`` runs it (``portal.stack.up``:
one uvicorn, channels_redis on Redis, PostgreSQL) on a fresh, migrated bench
database. Dashboards: one tab subscribed to ``cluster`` and tabs of 16 subscribed
to ``node.<id>`` for ``--watched`` of the nodes (all by default), so every frame
of a watched node can reach a browser.

For each N, after ``--warmup`` seconds (the connections made, over ``--ramp`` s)
and over ``--seconds`` (300 for the real figure):

- frames/s sent; the web process's CPU and each generator's (``/proc``, % of one
  core), and the whole machine's (``/proc/stat``: other people's work included);
- sample-to-dashboard latency (receipt time of a ``node.metrics`` minus the sample
  time it carries; same clock), p50 / p99, and the cluster deltas' (by design up
  to one interval later: docs/architecture.md, "Live dashboards");
- ack latency (send -> the server's ack), p50 / p99: the durable path's backlog;
- **lost**, against what the product promises to keep (docs/architecture.md,
  "Metric history"): every metrics frame is acked, and one sample per GPU per
  ``GPULAB_METRICS_PERSIST_INTERVAL`` (10 s) window of the connection is stored: the
  first frame of each window (``metrics.should_persist``). The frames in between
  are live-only by design (latest state, dashboards). Lost = frames never acked
  (after a ``--drain`` s wait once sending stops) + expected (GPU, sample time)
  rows missing from ``scheduler_gpusample`` + GPUs whose latest state is not the
  last frame sent (checked after the server shut down, as a disconnect writes it);
- sustained = nothing lost, node p99 < 1 s, frames/s within 2 % of N, every agent
  connected throughout.

``WEB_CONCURRENCY=N`` (uvicorn's own variable, as for ``make up``) runs N web
processes on the one port; "srv cpu" is then their sum, in % of one core.

``--profile`` records the web process with py-spy (if installed) at the largest N
that did not sustain (or the largest measured), and prints its top frames.

Prints a table and writes ``<out-dir>/ingest.json``. Never asserts on timings.
Run: ``python -m portal.stack.run -- python bench/ingest.py --nodes 50,100``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_cost import cpu_seconds, tree_cpu_seconds
from live_dashboard import (
    LIVE_IDS,
    AgentTrace,
    _ms,
    free_port,
    pct,
    run_agent,
    run_browser,
    start_server,
)
from pass_scaling import _admin_conninfo, _with_db, setup_django

ROOT = Path(__file__).resolve().parents[1]
TAB = 16  # nodes per browser tab (a tab's subscription budget)


# ------------------------------------------------------------------ generator


async def _generate(spec: dict[str, Any]) -> dict[str, Any]:
    """One load-generator process: its share of the agents and of the tabs."""
    url, nodes = spec["url"], spec["nodes"]
    LIVE_IDS.update(str(n["id"]) for n in nodes)
    stop, measuring = asyncio.Event(), asyncio.Event()
    record: dict[str, list[float]] = {
        "node": [],
        "cluster": [],
        "cluster_messages": [],
        "cluster_bytes": [],
    }
    sent = [0]
    tabs: list[list[dict[str, Any]]] = [[{"subscribe": "cluster"}]] * spec["cluster"]
    watched = [n for n in nodes if n["id"] in set(spec["watched"])]
    for first in range(0, len(watched), TAB):
        tabs.append(
            [{"subscribe": "node", "id": n["id"]} for n in watched[first : first + TAB]]
        )
    traces = {n["id"]: AgentTrace() for n in nodes}
    tasks = [
        asyncio.create_task(
            run_browser(url, spec["cookie"], subs, stop, record, measuring)
        )
        for subs in tabs
    ]
    tasks += [
        asyncio.create_task(
            run_agent(
                url,
                n,
                stop,
                sent,
                trace=traces[n["id"]],
                connect_delay=random.random() * spec["ramp"],
                drain_s=spec["drain"],
            )
        )
        for n in nodes
    ]
    lags: list[float] = []

    async def lag_probe() -> None:
        # the generator's own event-loop lag (an overloaded generator delays
        # both its frames and its receipts)
        while not stop.is_set():
            t0 = time.monotonic()
            await asyncio.sleep(0.1)
            if measuring.is_set():
                lags.append(time.monotonic() - t0 - 0.1)

    probe = asyncio.create_task(lag_probe())
    await asyncio.sleep(max(0.0, spec["measure_from"] - time.time()))
    measuring.set()
    frames0, t0 = sent[0], time.monotonic()
    await asyncio.sleep(max(0.0, spec["measure_until"] - time.time()))
    frames, elapsed = sent[0] - frames0, time.monotonic() - t0
    stop.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    probe.cancel()
    failures = Counter(repr(r)[:120] for r in results if isinstance(r, BaseException))
    ack_lat = [
        trace.acks[seq] - mono
        for trace in traces.values()
        for seq, (at, mono) in trace.sent.items()
        if seq in trace.acks and spec["measure_from"] <= at < spec["measure_until"]
    ]
    return {
        "frames": frames,
        "elapsed": elapsed,
        "node_latency": record["node"],
        "cluster_latency": record["cluster"],
        "ack_latency": ack_lat,
        "loop_lag": lags,
        "failures": dict(failures),
        "agents": {
            str(node_id): {
                "sent": [[seq, at] for seq, (at, _) in sorted(trace.sent.items())],
                "unacked": sorted(set(trace.sent) - set(trace.acks)),
                "errors": trace.errors[:5],
            }
            for node_id, trace in traces.items()
        },
    }


def generator_main(spec_path: str) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    sys.path.insert(0, str(ROOT))
    spec = json.loads(Path(spec_path).read_text())
    result = asyncio.run(_generate(spec))
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------ setup


def make_nodes(count: int) -> tuple[list[dict[str, Any]], str]:
    """``count`` registered nodes (tokens) and a signed-in staff session."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    from scheduler import services

    nodes = []
    for i in range(count):
        node, token = services.create_node(f"ingest-{i:04d}")
        nodes.append({"id": node.pk, "name": node.name, "token": token})
    staff = User.objects.create_user(
        "bench-admin", password="bench-pw-1", is_staff=True
    )
    client = Client()
    client.force_login(staff)
    return nodes, client.cookies[settings.SESSION_COOKIE_NAME].value


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, all cores."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return float(sum(fields) - idle), float(sum(fields))


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


# ------------------------------------------------------------------ checks


def check_stored(db_url: str, agents: dict[str, Any], interval: int) -> dict[str, int]:
    """Expected persisted rows (the first frame of each persistence window of the
    connection, all 8 GPUs) against ``scheduler_gpusample``."""
    node_ids, stamps = [], []
    for node_id, agent in agents.items():
        last: float | None = None
        for _, at in agent["sent"]:
            if last is None or int(at // interval) != int(last // interval):
                node_ids.append(int(node_id))
                stamps.append(datetime.fromtimestamp(at, tz=UTC))
            last = at
    with psycopg.connect(db_url) as conn:
        missing = conn.execute(
            """
            SELECT count(*) FROM unnest(%s::bigint[], %s::timestamptz[]) e(node, at)
            JOIN scheduler_gpu g ON g.node_id = e.node
            LEFT JOIN scheduler_gpusample s ON s.gpu_id = g.id AND s.at = e.at
            WHERE s.gpu_id IS NULL
            """,
            [node_ids, stamps],
        ).fetchone()
        gpus = conn.execute(
            "SELECT count(*) FROM scheduler_gpu WHERE node_id = ANY(%s)",
            [[int(n) for n in agents]],
        ).fetchone()
    assert missing is not None and gpus is not None
    return {
        "expected_rows": 8 * len(stamps),
        "missing_rows": int(missing[0]),
        "gpus_registered": int(gpus[0]),
    }


def check_latest(db_url: str, agents: dict[str, Any]) -> int:
    """GPUs whose latest state is not their node's last frame sent."""
    node_ids, stamps = [], []
    for node_id, agent in agents.items():
        if agent["sent"]:
            node_ids.append(int(node_id))
            stamps.append(datetime.fromtimestamp(agent["sent"][-1][1], tz=UTC))
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            """
            SELECT count(*) FROM unnest(%s::bigint[], %s::timestamptz[]) e(node, at)
            JOIN scheduler_gpu g ON g.node_id = e.node
            WHERE g.latest_at IS DISTINCT FROM e.at
            """,
            [node_ids, stamps],
        ).fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ one N


def measure(
    args: argparse.Namespace,
    db_url: str,
    nodes: list[dict[str, Any]],
    cookie: str,
    work: Path,
    profile_to: Path | None = None,
) -> dict[str, Any]:
    from django.conf import settings

    n = len(nodes)
    port = free_port()
    server_log = work / f"server-{n}.log"
    server = start_server(db_url, port, server_log)
    watched_count = n if args.watched is None else min(n, args.watched)
    watched = [node["id"] for node in nodes[:watched_count]]
    start = time.time() + 3  # the generators' interpreters start meanwhile
    measure_from = start + args.ramp + args.warmup
    measure_until = measure_from + args.seconds
    k = max(1, min(args.generators, n))
    gens: list[tuple[subprocess.Popen[bytes], Path]] = []
    spy: subprocess.Popen[bytes] | None = None
    out: dict[str, Any] = {"nodes": n, "gpus": 8 * n, "watched_nodes": watched_count}
    try:
        for i in range(k):
            spec = {
                "url": f"ws://127.0.0.1:{port}",
                "nodes": nodes[i::k],
                "watched": watched,
                "cluster": 1 if i == 0 else 0,
                "cookie": cookie,
                "ramp": args.ramp,
                "drain": args.drain,
                "measure_from": measure_from,
                "measure_until": measure_until,
                "out": str(work / f"gen-{n}-{i}.json"),
            }
            path = work / f"spec-{n}-{i}.json"
            path.write_text(json.dumps(spec))
            gens.append(
                (
                    subprocess.Popen(
                        [sys.executable, __file__, "--generator", str(path)], cwd=ROOT
                    ),
                    Path(spec["out"]),
                )
            )
        time.sleep(max(0.0, measure_from - time.time()))
        out["load_start"] = loadavg()
        cpu0 = {p.pid: cpu_seconds(p.pid) or 0.0 for p, _ in gens}
        srv0, busy0, wall0 = (
            tree_cpu_seconds(server.pid) or 0.0,
            machine_busy(),
            time.time(),
        )
        if profile_to is not None and shutil.which("py-spy", path=_venv_bin()):
            spy = subprocess.Popen(
                [shutil.which("py-spy", path=_venv_bin()) or "py-spy", "record",
                 "-p", str(server.pid), "--subprocesses",
                 "-d", str(int(args.seconds)), "-r", "50",
                 "--format", "raw", "-o", str(profile_to), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )  # fmt: skip
        time.sleep(max(0.0, measure_until - time.time()))
        wall = time.time() - wall0
        srv1, busy1 = tree_cpu_seconds(server.pid) or 0.0, machine_busy()
        cpu1 = {p.pid: cpu_seconds(p.pid) or 0.0 for p, _ in gens}
        out["load_end"] = loadavg()
        out["server_cpu_pct"] = round(100 * (srv1 - srv0) / wall, 1)
        out["generator_cpu_pct"] = [
            round(100 * (cpu1[pid] - cpu0[pid]) / wall, 1) for pid in cpu0
        ]
        cores = os.cpu_count() or 1
        out["machine_cpu_pct_of_all_cores"] = round(
            100 * (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1]), 1
        )
        out["cores"] = cores
        for proc, _ in gens:
            proc.wait(args.drain + 120)
        if spy is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(60)
    finally:
        for proc, _ in gens:
            if proc.poll() is None:
                proc.kill()
        if spy is not None and spy.poll() is None:
            spy.terminate()
    parts = [json.loads(path.read_text()) for _, path in gens if path.exists()]
    agents: dict[str, Any] = {}
    for part in parts:
        agents.update(part["agents"])
    interval = settings.GPULAB_METRICS_PERSIST_INTERVAL
    stored = check_stored(db_url, agents, interval)
    # The server's shutdown closes the sockets: each disconnect writes its
    # node's latest state before it ends.
    server.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(60)
    if server.poll() is None:
        server.kill()
    stale_latest = check_latest(db_url, agents)
    frames = sum(p["frames"] for p in parts)
    elapsed = max((p["elapsed"] for p in parts), default=1.0)
    node_lat = [x for p in parts for x in p["node_latency"]]
    cluster_lat = [x for p in parts for x in p["cluster_latency"]]
    ack_lat = [x for p in parts for x in p["ack_latency"]]
    lags = [x for p in parts for x in p["loop_lag"]]
    unacked = sum(len(a["unacked"]) for a in agents.values())
    sent_total = sum(len(a["sent"]) for a in agents.values())
    failures: Counter[str] = Counter()
    for p in parts:
        failures.update(p["failures"])
    errors = Counter(e for a in agents.values() for e in a["errors"])
    out.update(
        {
            "seconds": round(elapsed, 1),
            "frames_per_s": round(frames / elapsed, 1),
            "frames_sent_total": sent_total,
            "unacked": unacked,
            **stored,
            "stale_latest_gpus": stale_latest,
            "lost": unacked + stored["missing_rows"] + stale_latest,
            "node_p50_ms": _ms(pct(node_lat, 50)),
            "node_p99_ms": _ms(pct(node_lat, 99)),
            "node_updates": len(node_lat),
            "cluster_p50_ms": _ms(pct(cluster_lat, 50)),
            "cluster_p99_ms": _ms(pct(cluster_lat, 99)),
            "ack_p50_ms": _ms(pct(ack_lat, 50)),
            "ack_p99_ms": _ms(pct(ack_lat, 99)),
            "generator_loop_lag_p99_ms": _ms(pct(lags, 99)),
            "agent_failures": dict(failures),
            "server_errors": dict(errors.most_common(5)),
            "server_log_tail": _tail(server_log),
        }
    )
    out["sustained"] = bool(
        out["lost"] == 0
        and not failures
        and out["node_p99_ms"] is not None
        and out["node_p99_ms"] < 1000
        and out["frames_per_s"] >= 0.98 * n
        and stored["gpus_registered"] == 8 * n
    )
    return out


def _venv_bin() -> str:
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def _tail(path: Path, lines: int = 8) -> list[str]:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace").splitlines()[-lines:]
    return []


# ------------------------------------------------------------------ profile


def profile_top(raw: Path, keep: int = 15) -> dict[str, list[str]]:
    """py-spy's collapsed stacks -> the top frames by own samples and by
    inclusive samples (each frame counted once per stack)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count

    def fmt(counter: Counter[str]) -> list[str]:
        return [
            f"{100 * c / max(1, total):5.1f}%  {frame}"
            for frame, c in counter.most_common(keep)
        ]

    project = Counter(
        {
            f: c
            for f, c in inclusive.items()
            if any(
                k in f for k in ("(scheduler/", "(portal/", "(channels", "(psycopg/")
            )
        }
    )
    return {
        "samples": [str(total)],
        "own": fmt(own),
        "inclusive": fmt(inclusive),
        "project_inclusive": fmt(project),
    }


# ------------------------------------------------------------------ main


def print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['nodes']:>6} {r['gpus']:>6} {r['frames_per_s']:>8} "
        f"{r['server_cpu_pct']:>7} {'+'.join(str(c) for c in r['generator_cpu_pct']):>11} "
        f"{r['machine_cpu_pct_of_all_cores']:>6} "
        f"{r['node_p50_ms']!s:>8} {r['node_p99_ms']!s:>8} {r['ack_p99_ms']!s:>8} "
        f"{r['cluster_p99_ms']!s:>8} {r['lost']:>6} {'yes' if r['sustained'] else 'NO':>4}"
        f"   load {r['load_start']} -> {r['load_end']}",
        flush=True,
    )


HEADER = (
    f"{'nodes':>6} {'gpus':>6} {'frames/s':>8} {'srv cpu':>7} {'gen cpu %':>11} "
    f"{'mach%':>6} {'p50 ms':>8} {'p99 ms':>8} {'ack p99':>8} {'clus p99':>8} "
    f"{'lost':>6} {'ok':>4}"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="50,100,200,400,800,1000")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--ramp", type=float, default=10.0)
    parser.add_argument("--drain", type=float, default=30.0)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--watched", type=int, default=None)
    parser.add_argument("--stop-after-failure", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--generator", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generator:
        return generator_main(args.generator)
    counts = sorted({int(x) for x in args.nodes.split(",") if x.strip()})
    url = os.environ["DATABASE_URL"]
    name = f"bench_ingest_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    work = Path(tempfile.mkdtemp(prefix="ingest-"))
    result: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "mem_gib": _mem_gib(),
        "web_processes": int(os.environ.get("WEB_CONCURRENCY") or 1),
        "args": vars(args),
        "runs": [],
    }
    print(f"machine: {result['cpu']}, {result['cores']} cores, "
          f"{result['mem_gib']} GiB; {result['web_processes']} web process(es); "
          f"load {loadavg()}", flush=True)  # fmt: skip
    try:
        db_url = _with_db(url, name)
        setup_django(db_url)
        nodes, cookie = make_nodes(max(counts))
        from django.db import connections

        connections.close_all()
        print(HEADER, flush=True)
        for n in counts:
            run = measure(args, db_url, nodes[:n], cookie, work)
            result["runs"].append(run)
            print_row(run)
            if run["agent_failures"] or run["server_errors"]:
                print(f"       failures {run['agent_failures']} errors "
                      f"{run['server_errors']}")  # fmt: skip
            if not run["sustained"] and args.stop_after_failure:
                break
        if args.profile and result["runs"]:
            failed = [r for r in result["runs"] if not r["sustained"]]
            target = (failed[0] if failed else result["runs"][-1])["nodes"]
            raw = work / f"profile-{target}.txt"
            print(f"profiling the web process at {target} nodes (py-spy)", flush=True)
            run = measure(args, db_url, nodes[:target], cookie, work, profile_to=raw)
            print_row(run)
            run["profile"] = profile_top(raw) if raw.exists() else None
            if raw.exists():
                Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                shutil.copy(raw, Path(args.out_dir) / f"ingest-profile-{target}.txt")
            result["profile"] = run
            if run["profile"]:
                print(f"  {run['profile']['samples'][0]} samples; top by own time:")
                print("\n".join("    " + x for x in run["profile"]["own"]))
                print("  top project / driver frames by inclusive time:")
                print(
                    "\n".join("    " + x for x in run["profile"]["project_inclusive"])
                )
        sustained = [r["nodes"] for r in result["runs"] if r["sustained"]]
        result["largest_sustained"] = max(sustained, default=None)
        print(f"largest N sustained: {result['largest_sustained']}")
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ingest.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def _mem_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
