"""Cost of a Prometheus scrape of ``/metrics`` on a lab's worth of history.

A fresh database filled as ``bench/admin_overview.py`` fills it (8 nodes of 8 GPUs,
``--jobs`` jobs over 30 days with their attempts, allocations and usage records,
the last job on each GPU still running, minute and hour rollups), plus
``--pending`` pending jobs spread over the waiting reasons, a quota per group, the
nodes connected with a reading per GPU, and 100 pass records in Redis. Then
``--requests`` scrapes of ``/metrics`` through Django's test client with the bearer
token (after two to warm up): p50 / p95 / max, the body's size and series count,
and each part of the collector alone (median time and queries). Prints them; writes
``bench/results/metrics_scrape.json``. No goal is asserted: Prometheus' default
scrape timeout is 10 s; a scrape should take well under a second.

Run through ``make bench`` (it provides DATABASE_URL / REDIS_URL), or:
``python -m portal.stack.run -- python bench/metrics_scrape.py``.
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

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from admin_overview import populate
from pass_scaling import _admin_conninfo, _with_db, setup_django

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-metrics-token-0123456789"
REASONS = ["resources", "priority", "quota", "dependency", "reserved", ""]


def add_queue_and_readings(pending: int) -> None:
    """Pending jobs, quotas, connected nodes with readings, pass records."""
    from django.contrib.auth.models import User
    from django.utils import timezone

    from portal.quotas.models import Quota
    from scheduler import pass_log
    from scheduler.models import Gpu, Group, Job, Node

    now = timezone.now()
    users = list(User.objects.select_related().all()[:40])
    groups = {g.pk: g for g in Group.objects.all()}
    owners = [(u, u.lab_groups.first()) for u in users]
    fallback = next(iter(groups.values()))
    Job.objects.bulk_create(
        Job(
            owner=owners[i % len(owners)][0],
            group=owners[i % len(owners)][1] or fallback,
            name=f"wait-{i}",
            command="true",
            workdir="/tmp",
            time_limit_s=3600,
            status=Job.Status.PENDING,
            pending_reason=REASONS[i % len(REASONS)],
            submitted_at=now,
        )
        for i in range(pending)
    )
    for group in groups.values():
        Quota.objects.create(group=group, gpu_hours=1000)
    Node.objects.update(connected=True)
    for gpu in Gpu.objects.all():
        Gpu.objects.filter(pk=gpu.pk).update(
            latest={
                "index": gpu.index,
                "uuid": gpu.uuid,
                "util_gpu": 50.0 + gpu.index,
                "memory_used_mib": 1000,
                "power_w": 200.0,
                "temperature_c": 60.0,
            },
            latest_at=now,
        )
    for i in range(100):
        pass_log.keep(
            pass_log.PassRecord(
                at=time.time(), considered=pending, started=i % 3, preempted=0,
                reserved=1, backfilled=0, stop_reason=pass_log.QUEUE_EXHAUSTED,
                load_s=0.01, decide_s=0.02, apply_s=0.01, total_s=0.04 + i / 1000,
            )
        )  # fmt: skip


def scrapes(requests: int) -> dict[str, Any]:
    from django.conf import settings
    from django.test import Client

    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    settings.GPULAB_METRICS_TOKEN = TOKEN
    client = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    for _ in range(2):
        assert client.get("/metrics", **auth).status_code == 200
    body = client.get("/metrics", **auth).content.decode()
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        response = client.get("/metrics", **auth)
        times.append((time.perf_counter() - t0) * 1000)
        assert response.status_code == 200
    times.sort()
    series = [line for line in body.splitlines() if line and not line.startswith("#")]
    return {
        "requests": requests,
        "p50_ms": round(statistics.median(times), 1),
        "p95_ms": round(statistics.quantiles(times, n=20)[18], 1),
        "max_ms": round(times[-1], 1),
        "series": len(series),
        "bytes": len(body),
    }


def _sum_over_records() -> list[tuple[str, float]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT g.name, coalesce(sum(r.gpu_seconds), 0) FROM scheduler_group g"
            " LEFT JOIN scheduler_usagerecord r ON r.group_id = g.id"
            " GROUP BY g.name ORDER BY g.name"
        )
        return [(name, float(s)) for name, s in cursor.fetchall()]


def parts(repeat: int) -> dict[str, Any]:
    """Each part of the collector alone: median time and queries."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from portal.prometheus import collector, ledger
    from portal.quotas.usage import quota_states

    now = timezone.now()
    out: dict[str, Any] = {}
    for name, fn in {
        "jobs": lambda: list(collector.jobs(now)),
        "passes": lambda: list(collector.passes()),
        "cluster": lambda: list(collector.cluster(now)),
        "charges": lambda: list(collector.charges(now)),
        # Its two halves: the GPU-hours per group from the kept totals, and the
        # same figure summed over every usage record (the scrape's query before
        # the totals), for comparison on the same data and load.
        "group_hours": lambda: (ledger.fold(), ledger.group_seconds()),
        "group_hours_by_sum": lambda: _sum_over_records(),
        "quotas": lambda: quota_states(now),
        "ingest": lambda: list(collector.ingest(now)),
    }.items():
        times = []
        for _ in range(repeat):
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
    parser.add_argument("--pending", type=int, default=2_000)
    parser.add_argument("--requests", type=int, default=30)
    # `make bench` passes every script --out-dir (bench/README.md).
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    name = f"bench_metrics_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        setup_django(_with_db(url, name))
        t0 = time.perf_counter()
        populate(args.jobs)
        add_queue_and_readings(args.pending)
        print(f"populated {args.jobs} jobs + {args.pending} pending in"
              f" {time.perf_counter() - t0:.0f} s")  # fmt: skip
        result = {
            "jobs": args.jobs,
            "pending": args.pending,
            "load_avg": os.getloadavg()[0],
            **scrapes(args.requests),
            "parts": parts(5),
        }
        print(json.dumps(result, indent=2))
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics_scrape.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(_admin_conninfo(url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
