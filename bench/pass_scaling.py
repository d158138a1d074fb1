"""Cost of one full scheduling pass against PostgreSQL, at several sizes.

For each size (pending jobs on GPUs): a fresh database, nodes of 8 GPUs, all GPUs
but 100 held by running jobs, then ``scheduler.pass_runner.run_one_pass()`` (load the state
in a fixed number of queries, one ``decide``, one transaction to apply, which starts
up to 100 jobs) timed over a few repetitions, the started jobs being put back to
pending between repetitions. A first, separately reported pass stores every job's
reason; the timed ones are the steady state (only changed reasons are written).
Prints, per size, the median pass and its parts (state load, decide, starts,
preemptions, storing the waits' reasons), the client's CPU time (steadier than wall
time on a busy machine) and the queries; writes ``pass_scaling.json``. The goal:
under a second at 10,000 pending on 4,096 GPUs, in a number of queries that does
not grow with the queue. The current figures, with the machine, are in
docs/benchmarks.md, "Scheduling pass".

Run through ``make bench`` (it provides DATABASE_URL / REDIS_URL), or:
``python -m portal.stack.run -- python bench/pass_scaling.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(100, 64), (1_000, 512), (10_000, 4_096)]
FREE_GPUS = 100


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def _admin_conninfo(url: str) -> str:
    return _with_db(url, "postgres")


def setup_django(db_url: str) -> None:
    os.environ["DATABASE_URL"] = db_url
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ["GPULAB_REDIS_PREFIX"] = f"gpulab-bench-{uuid.uuid4().hex[:8]}"
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def populate(pending: int, gpus: int) -> None:
    from django.contrib.auth.models import User
    from django.utils import timezone

    from scheduler.models import Allocation, Attempt, Gpu, Group, Job, Membership, Node

    now = timezone.now()
    groups = [Group.objects.create(name=f"g{i}", shares=1 + i % 3) for i in range(8)]
    users = []
    for i in range(40):
        user = User.objects.create(username=f"u{i}")
        Membership.objects.create(user=user, group=groups[i % len(groups)])
        users.append(user)
    nodes = Node.objects.bulk_create(
        [
            Node(
                name=f"n{i:04d}",
                token_hash=uuid.uuid4().hex,
                status=Node.Status.UP,
                last_seen_at=now,
            )
            for i in range(gpus // 8)
        ]
    )
    gpu_rows = Gpu.objects.bulk_create(
        [
            Gpu(
                node=node,
                index=i,
                uuid=f"GPU-{node.name}-{i}",
                name="NVIDIA A100-80GB",
                memory_total_mib=81920,
                slots=2,
                nvlink_peers=[j for j in range(8) if j != i],
            )
            for node in nodes
            for i in range(8)
        ]
    )
    busy = gpu_rows[: max(0, len(gpu_rows) - FREE_GPUS)]
    running = Job.objects.bulk_create(
        [
            Job(
                owner=users[i % len(users)],
                group=groups[i % len(groups)],
                name=f"r{i}",
                command="train",
                workdir="/tmp",
                gpus=1,
                time_limit_s=86400,
                status=Job.Status.RUNNING,
                submitted_at=now,
                started_at=now,
                attempts=1,
            )
            for i in range(len(busy))
        ]
    )
    attempts = Attempt.objects.bulk_create(
        [
            Attempt(job=job, number=1, node_id=gpu.node_id, started_at=now)
            for job, gpu in zip(running, busy, strict=True)
        ]
    )
    Allocation.objects.bulk_create(
        [
            Allocation(attempt=attempt, gpu=gpu, slot=slot)
            for attempt, gpu in zip(attempts, busy, strict=True)
            for slot in range(2)
        ]
    )
    Job.objects.bulk_create(
        [
            Job(
                owner=users[i % len(users)],
                group=groups[i % len(groups)],
                name=f"p{i}",
                command="train",
                workdir="/tmp",
                gpus=[1, 1, 1, 2, 4, 8][i % 6],
                time_limit_s=3600 * (1 + i % 24),
                submitted_at=now - timezone.timedelta(seconds=i),
            )
            for i in range(pending)
        ]
    )
    # Statistics as a database in service has them (autovacuum analyzes a table
    # within a minute of such a change): without them the planner takes the
    # fresh tables for near empty and the running attempts' charges query
    # (portal.accounting.live) goes quadratic, 3.4 s at 10,240 GPUs.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def reset_started(before: set[int]) -> None:
    """Put the jobs the timed pass started back to pending (untimed)."""
    from scheduler.models import Allocation, Attempt, Job

    started = Job.objects.filter(status=Job.Status.STARTING).exclude(pk__in=before)
    ids = list(started.values_list("pk", flat=True))
    Allocation.objects.filter(attempt__job_id__in=ids).delete()
    Attempt.objects.filter(job_id__in=ids).delete()
    Job.objects.filter(pk__in=ids).update(
        status=Job.Status.PENDING, attempts=0, pending_reason=""
    )


PARTS = ("state", "decide", "starts", "preempts", "waits")


def measure(pending: int, gpus: int, repeats: int) -> dict[str, Any]:
    from unittest import mock

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from scheduler import pass_runner, services

    populate(pending, gpus)
    passes: list[dict[str, Any]] = []
    with (
        mock.patch("scheduler.events.send_to_agent"),
        mock.patch("scheduler.events.broadcast_job_status"),
        mock.patch("scheduler.tasks.schedule_pass.delay"),
    ):
        # The first pass stores every job's reason (all new); later ones only
        # what changed. Timed apart: the steady state is what the goal is about.
        first = pass_runner.run_one_pass()
        reset_started(set())
        for _ in range(repeats):
            with CaptureQueriesContext(connection) as ctx:
                cpu = time.process_time()
                result = pass_runner.run_one_pass()
                result["cpu_ms"] = (time.process_time() - cpu) * 1000
            result["queries"] = len(ctx.captured_queries)
            result["slowest"] = sorted(
                (
                    (float(q["time"]) * 1000, " ".join(q["sql"].split())[:160])
                    for q in ctx.captured_queries
                ),
                reverse=True,
            )[:3]
            passes.append(result)
            reset_started(set())

    def median(key: str) -> float:
        return round(statistics.median(p[key] for p in passes), 1)

    return {
        "pending": pending,
        "gpus": gpus,
        "free_gpus": FREE_GPUS,
        "policy": services.policy_config().name,
        "pass_ms_median": median("ms"),
        "pass_ms_max": round(max(p["ms"] for p in passes), 1),
        # Wall time of each part (median over the passes): load the state, decide,
        # apply the starts, the preemptions and the waits' reasons.
        **{f"{part}_ms_median": median(f"ms_{part}") for part in PARTS},
        # CPU time of this (client) process: less sensitive to a busy machine.
        "cpu_ms_median": median("cpu_ms"),
        "queries_per_pass": passes[-1]["queries"],
        "started_per_pass": passes[-1]["started"],
        "reasons_updated_per_pass": passes[-1]["reasons_updated"],
        # The last timed pass's three slowest queries: (ms, the SQL's start).
        "slowest_queries": passes[-1]["slowest"],
        "first_pass_ms": first["ms"],
        "first_pass_reasons_updated": first["reasons_updated"],
    }


def run_one_size(pending: int, gpus: int, repeats: int) -> dict[str, Any]:
    base = os.environ["DATABASE_URL"]
    name = f"gpulab_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_conninfo(base), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        # Each size in its own process: Django is set up once per process.
        import subprocess

        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                f"{pending},{gpus},{repeats}",
            ],
            env={**os.environ, "DATABASE_URL": _with_db(base, name)},
            capture_output=True,
            text=True,
            check=True,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        with psycopg.connect(_admin_conninfo(base), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _sizes(text: str) -> list[tuple[int, int]]:
    """``"1000:512,20000:10240"`` -> [(1000, 512), (20000, 10240)]; GPUs in whole
    nodes of 8, more than the ``FREE_GPUS`` left free."""
    sizes = []
    for item in text.split(","):
        pending, sep, gpus = item.strip().partition(":")
        if not sep or not pending.isdigit() or not gpus.isdigit():
            raise ValueError(f"{item.strip()!r} is not PENDING:GPUS")
        if int(gpus) % 8 or int(gpus) <= FREE_GPUS:
            raise ValueError(f"{gpus} GPUs: need a multiple of 8 above {FREE_GPUS}")
        sizes.append((int(pending), int(gpus)))
    return sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-pending", type=int, default=10_000)
    ap.add_argument(
        "--sizes",
        help="pending:GPUs pairs instead of the default table, e.g. 20000:10240"
        " (docs/scaling.md's department size)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        pending, gpus, repeats = (int(x) for x in args.child.split(","))
        setup_django(os.environ["DATABASE_URL"])
        print(json.dumps(measure(pending, gpus, repeats)))
        return 0
    if not os.environ.get("DATABASE_URL"):
        print("DATABASE_URL is not set: run through `make bench`", file=sys.stderr)
        return 2
    try:
        sizes = _sizes(args.sizes) if args.sizes else SIZES
    except ValueError as exc:
        print(f"--sizes: {exc}", file=sys.stderr)
        return 2
    rows = []
    for pending, gpus in sizes:
        if pending > args.max_pending:
            continue
        row = run_one_size(pending, gpus, args.repeats)
        rows.append(row)
        parts = ", ".join(f"{part} {row[f'{part}_ms_median']:.0f}" for part in PARTS)
        print(
            f"{pending:>7} pending {gpus:>5} GPUs: pass {row['pass_ms_median']:>7.1f} ms"
            f" (max {row['pass_ms_max']:.0f}; cpu {row['cpu_ms_median']:.0f}) = {parts};"
            f" {row['queries_per_pass']} queries, started {row['started_per_pass']},"
            f" {row['reasons_updated_per_pass']} reasons written;"
            f" first pass {row['first_pass_ms']:.0f} ms"
            f" ({row['first_pass_reasons_updated']} reasons)",
            flush=True,
        )
        for ms, sql in row["slowest_queries"]:
            print(f"    {ms:8.1f} ms  {sql}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pass_scaling.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
