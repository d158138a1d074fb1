"""Cost of the admin overview's figures at scale (issue 6: 100k jobs, 30 days of
metrics of 64 GPUs).

A fresh database: 8 nodes of 8 GPUs, ``--jobs`` jobs spread over the last 30 days
one after another on each GPU (each with its attempt, its two slot allocations and
its usage record; the last on each GPU still running), and a minute rollup per GPU
per minute for 30 days (2.76 million rows at 64 GPUs) plus the hourly ones. Then
times ``group_usage``, ``daily_figures`` and ``nodes_needing_attention`` (median
of ``--repeat``) and prints them; writes ``bench/results/admin_overview.json``.

Measured once on our 2-core machine (shared): group usage 33 ms (1 query), nodes
needing attention 2 ms (1 query), but the daily figures 13.5 s (4 queries): the
30-day figures miss the goal at this scale (docs/architecture.md, "Admin console").

Run through ``make bench`` (it provides DATABASE_URL / REDIS_URL), or:
``python -m portal.stack.run -- python bench/admin_overview.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_scaling import _admin_conninfo, _with_db, setup_django

ROOT = Path(__file__).resolve().parents[1]
GPUS = 64
DAYS = 30


def populate(jobs: int) -> None:
    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone

    from scheduler.models import (
        Allocation,
        Attempt,
        Gpu,
        Group,
        Job,
        Membership,
        Node,
        UsageRecord,
    )

    now = timezone.now()
    since = now - timedelta(days=DAYS)
    groups = [Group.objects.create(name=f"g{i}") for i in range(8)]
    users = []
    for i in range(40):
        user = User.objects.create(username=f"u{i}")
        Membership.objects.create(user=user, group=groups[i % len(groups)])
        users.append(user)
    nodes = Node.objects.bulk_create(
        Node(name=f"n{i}", token_hash=uuid.uuid4().hex, status=Node.Status.UP)
        for i in range(GPUS // 8)
    )
    gpus = Gpu.objects.bulk_create(
        Gpu(
            node=node,
            index=i,
            uuid=f"GPU-{node.name}-{i}",
            name="NVIDIA A100-80GB",
            memory_total_mib=81920,
            slots=2,
        )
        for node in nodes
        for i in range(8)
    )
    per_gpu = -(-jobs // GPUS)
    span = DAYS * 86400 / per_gpu
    batch = 10_000
    for first in range(0, jobs, batch):
        rows = []
        for i in range(first, min(jobs, first + batch)):
            k = i // GPUS
            start = since + timedelta(seconds=k * span)
            live = k == per_gpu - 1
            end = None if live else start + timedelta(seconds=span * 0.95)
            rows.append((i, start, end))
        made = Job.objects.bulk_create(
            Job(
                owner=users[i % 40],
                group=groups[i % 8],
                name=f"j{i}",
                command="train",
                workdir="/tmp",
                time_limit_s=86400,
                status=Job.Status.RUNNING if end is None else Job.Status.COMPLETED,
                submitted_at=start,
                started_at=start,
                finished_at=end,
                attempts=1,
            )
            for i, start, end in rows
        )
        attempts = Attempt.objects.bulk_create(
            Attempt(
                job=job,
                number=1,
                node_id=gpus[i % GPUS].node_id,
                created_at=start,
                started_at=start,
                ended_at=end,
                outcome="" if end is None else Attempt.Outcome.EXITED,
            )
            for job, (i, start, end) in zip(made, rows, strict=True)
        )
        Allocation.objects.bulk_create(
            Allocation(
                attempt=attempt,
                gpu=gpus[i % GPUS],
                slot=slot,
                allocated_at=start,
                released_at=end,
            )
            for attempt, (i, start, end) in zip(attempts, rows, strict=True)
            for slot in range(2)
        )
        UsageRecord.objects.bulk_create(
            UsageRecord(
                attempt=attempt,
                gpu=gpus[i % GPUS],
                user_id=job.owner_id,
                group_id=job.group_id,
                started_at=start,
                ended_at=end,
                share=1.0,
                gpu_seconds=(end - start).total_seconds(),
            )
            for job, attempt, (i, start, end) in zip(made, attempts, rows, strict=True)
            if end is not None
        )
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO scheduler_gpurollup (gpu_id, resolution, start, samples,
                                             util_gpu_mean, memory_used_max)
            SELECT g.id, '1m', m, 6, (abs(hashtext(g.id::text || m::text)) %% 100),
                   20000
            FROM scheduler_gpu g,
                 generate_series(date_trunc('minute', %(since)s::timestamptz),
                                 %(now)s::timestamptz, interval '1 minute') m
            """,
            {"since": since, "now": now},
        )
        cursor.execute(
            """
            INSERT INTO scheduler_gpurollup (gpu_id, resolution, start, samples,
                                             util_gpu_mean)
            SELECT gpu_id, '1h', date_trunc('hour', start), sum(samples),
                   avg(util_gpu_mean)
            FROM scheduler_gpurollup WHERE resolution = '1m'
            GROUP BY 1, 3
            """
        )
        cursor.execute("ANALYZE")


def measure(repeat: int) -> dict[str, Any]:
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from scheduler import overview

    now = timezone.now()
    figures = {
        "group_usage": lambda: overview.group_usage(overview.month_start(now), now),
        "daily_figures": lambda: overview.daily_figures(now),
        "nodes_needing_attention": lambda: list(overview.nodes_needing_attention()),
    }
    out: dict[str, Any] = {}
    for name, fn in figures.items():
        times = []
        for _ in range(repeat):
            reset_queries()
            with CaptureQueriesContext(connection) as ctx:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000)
        out[name] = {
            "median_ms": round(statistics.median(times), 1),
            "queries": len(ctx),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    # `make bench` passes every script --out-dir (bench/README.md).
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    name = f"bench_overview_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        setup_django(_with_db(url, name))
        t0 = time.perf_counter()
        populate(args.jobs)
        print(f"populated {args.jobs} jobs, {GPUS} GPUs x {DAYS} days of minute"
              f" rollups in {time.perf_counter() - t0:.0f} s")  # fmt: skip
        result = {"jobs": args.jobs, "gpus": GPUS, "days": DAYS, **measure(args.repeat)}
        print(json.dumps(result, indent=2))
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "admin_overview.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


if __name__ == "__main__":
    main()
