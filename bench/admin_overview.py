"""Cost of the admin overview at scale (100k jobs, 30 days of metrics of 64 GPUs),
figure by figure and as a whole page.

A fresh database: 8 nodes of 8 GPUs, ``--jobs`` jobs spread over the last 30 days
one after another on each GPU (each with its attempt, its two slot allocations and
its usage record; the last on each GPU still running), a minute rollup per GPU per
minute for 30 days (2.76 million rows at 64 GPUs) plus the hourly ones, and
``--sample-hours`` of raw samples (every 10 s, each naming the process of the
attempt holding the GPU; 553k rows for 24 h). Then: the GPU hours backfilled as
the first ``maintain_hours`` runs after the migration do it; ``group_usage``,
``daily_figures`` and ``nodes_needing_attention`` (median of ``--repeat``); a
routine ``hours.maintain`` (beat's every minute); and the whole ``/admin/overview/``
page through Django's test client signed in as staff (p50 / p95 over
``--requests`` after two warm-ups). Prints them; writes
``bench/results/admin_overview.json``. The goal: the whole page's p95 under
200 ms. The current figures, with the machine they were measured on, are in
docs/benchmarks.md, "Admin overview".

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


def populate_samples(hours_back: int) -> int:
    """Persisted samples of every GPU every 10 s over the last ``hours_back``
    hours, each listing the process of the attempt holding the GPU then (its SM
    pseudo-random, under 5 % a tenth of the time: idle evidence), as the
    consumer stores them. Returns rows."""
    from django.db import connection
    from django.utils import timezone

    from scheduler import metrics

    now = timezone.now()
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, now)
        cursor.execute(
            """
            INSERT INTO scheduler_gpusample (gpu_id, at, util_gpu, memory_used_mib,
                                             lost, processes)
            SELECT g.id, ts, sm, 20000, false,
                   CASE WHEN a.attempt_id IS NULL THEN '[]'::jsonb
                   ELSE jsonb_build_array(jsonb_build_object(
                       'pid', 100, 'used_memory_mib', 20000, 'sm_util', sm,
                       'attempt_id', a.attempt_id)) END
            FROM scheduler_gpu g
            CROSS JOIN generate_series(
                date_trunc('minute', %(now)s::timestamptz) - %(back)s::interval,
                %(now)s::timestamptz, interval '10 seconds') ts
            CROSS JOIN LATERAL (SELECT (abs(hashtext(g.id::text || ts::text))
                                        %% 1000) / 10.0 AS sm) u
            LEFT JOIN scheduler_allocation a
              ON a.gpu_id = g.id AND a.slot = 0 AND a.allocated_at <= ts
             AND (a.released_at IS NULL OR a.released_at > ts)
            """,
            {"now": now, "back": f"{hours_back} hours"},
        )
        rows = cursor.rowcount
        cursor.execute("ANALYZE scheduler_gpusample")
    return int(rows)


def backfill_hours() -> dict[str, Any]:
    """What the first runs of ``maintain_hours`` do after the migration: the
    GPU hours from its mark (31 days back), a day per transaction, a run at a
    time (each stops after its time budget)."""
    from django.utils import timezone

    from portal.accounting import hours
    from portal.accounting.models import GpuHour

    t0 = time.perf_counter()
    runs = 0
    while True:
        runs += 1
        now = timezone.now()
        done = hours.maintain(now)
        if (
            done.get("gpu_hours_through", "")
            >= hours._floor(now, timedelta(minutes=1)).isoformat()
        ):
            break
    return {
        "backfill_s": round(time.perf_counter() - t0, 1),
        "backfill_runs": runs,
        "gpu_hour_rows": GpuHour.objects.count(),
    }


def routine_maintain(repeat: int) -> dict[str, Any]:
    """One ``hours.maintain`` as beat runs it every minute once caught up (the
    last ten minutes and the hour they touch, from the samples)."""
    from django.utils import timezone

    from portal.accounting import hours

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        hours.maintain(timezone.now())
        times.append((time.perf_counter() - t0) * 1000)
    return {"median_ms": round(statistics.median(times), 1)}


def page_render(requests: int) -> dict[str, Any]:
    """The whole /admin/overview/ page through Django's test client, signed in as
    staff: p50 / p95 over ``requests`` requests (after two to warm up)."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    staff = User.objects.create_superuser("bench-admin", "a@b.c", "pw")
    client = Client()
    client.force_login(staff)
    for _ in range(2):
        assert client.get("/admin/overview/").status_code == 200
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        response = client.get("/admin/overview/")
        times.append((time.perf_counter() - t0) * 1000)
        assert response.status_code == 200
    times.sort()
    return {
        "requests": requests,
        "p50_ms": round(statistics.median(times), 1),
        "p95_ms": round(statistics.quantiles(times, n=20)[18], 1),
        "max_ms": round(times[-1], 1),
    }


def measure(repeat: int) -> dict[str, Any]:
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from portal import overview

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
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument(
        "--sample-hours", type=int, default=24,
        help="hours of raw samples to store (idle evidence; kept 7 days)",
    )  # fmt: skip
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
        t0 = time.perf_counter()
        stored = populate_samples(args.sample_hours)
        print(f"stored {stored} samples ({args.sample_hours} h) in"
              f" {time.perf_counter() - t0:.0f} s")  # fmt: skip
        backfill = backfill_hours()
        print(f"GPU hours backfilled: {backfill}")
        result = {
            "jobs": args.jobs,
            "gpus": GPUS,
            "days": DAYS,
            "sample_hours": args.sample_hours,
            "samples": stored,
            **backfill,
            **measure(args.repeat),
            "maintain_routine": routine_maintain(args.repeat),
            "page": page_render(args.requests),
        }
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
