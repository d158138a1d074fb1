"""The most expensive requests a member can make, alone and four at once, and what
other users' API calls cost meanwhile (issue #27, "Every request has a bounded
cost").

A fresh, migrated database: 8 nodes of 8 GPUs, ``--jobs`` (100,000) jobs of 40
users in 8 groups spread over the last ``--days`` (365) one after another on
each GPU, each with its attempt and usage record, and the per-day rows the Usage
reads (``DailyUsage``, one per record and UTC day). The member is ``u0``, the
leader of group ``g0`` (12,500 jobs of 5 users: a leader sees the group's usage
and jobs, the most a non-staff user may see); one of its jobs has a full log
(``GPULAB_LOG_MAX_BYTES``, in 64 KiB chunks). Then the web process exactly as
``make up`` runs it (uvicorn, its ASGI gate; ``live_dashboard.start_server``),
and over HTTP with API tokens (httpx):

1. each candidate for the most expensive request, alone (median of
   ``--repeat``): the widest usage range allowed (``GPULAB_USAGE_MAX_DAYS`` up to
   today) of the group through the API, and of the member alone; the Usage
   page and its CSV export of the group over that range (session login); the
   biggest page of the job list (``limit`` = ``GPULAB_API_MAX_PAGE``); the log's
   biggest tail; and the refused ones (``from=0001-01-01&to=9999-12-31``), which
   must cost nothing. Prints time and bytes of each;
2. another user (``u1``, group ``g1``: 2,500 jobs) polling ``/api/v1/me/`` and
   ``/api/v1/jobs/`` alone for a quarter of ``--seconds`` (the baseline);
3. the costliest of them four at once from the member, over and over, for
   ``--seconds`` (20), while that user polls
   ``/api/v1/me/`` and ``/api/v1/jobs/`` one after the other: that user's p50 /
   p95 / max per endpoint (goal: p95 under 200 ms), the member's request times,
   and the web process's RSS before and after (from ``/proc``).

``--keep-database`` keeps the populated database (its name is printed) and
``--database NAME`` measures on it again without populating (about 1-2 minutes
saved per run).

Steps 2 and 3 run in a web process of their own for each ``--variant`` (gate
settings, e.g. ``GPULAB_WEB_HEAVY_CONCURRENCY=0`` for no heavy cap), each of
``--rounds`` times in turn, on the same data. Prints the figures with the
machine's load, then one ``GOAL`` line per run (others' p95 of both endpoints,
their p50 beside the four, their p50 and p95 alone, the load), and writes ``<out-dir>/bounded_cost.json``. Run through ``make bench`` or
``python -m portal.stack.run -- python bench/bounded_cost.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import statistics
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_dashboard import start_server
from pass_scaling import _admin_conninfo, _with_db, setup_django
from real_stack import free_port, fresh_database, loadavg, machine, pct

if TYPE_CHECKING:
    from collections.abc import Iterator

GPUS = 64
USERS = 40
GROUPS = 8
CHUNK = 64 * 1024
GOAL_MS = 200  # others' API p95 beside four of the costliest


def populate(jobs: int, days: int) -> dict[str, Any]:
    """The history (see the docstring); returns what the requests need."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone

    from scheduler.models import (
        Attempt,
        Gpu,
        Group,
        Job,
        JobLogChunk,
        Membership,
        Node,
        UsageRecord,
    )

    now = timezone.now()
    since = now - timedelta(days=days)
    groups = [Group.objects.create(name=f"g{i}") for i in range(GROUPS)]
    users = []
    for i in range(USERS):
        user = User.objects.create(username=f"u{i}")
        Membership.objects.create(user=user, group=groups[i % GROUPS], is_leader=i == 0)
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
        )
        for node in nodes
        for i in range(8)
    )
    per_gpu = -(-jobs // GPUS)
    span = days * 86400 / per_gpu
    batch = 10_000
    for first in range(0, jobs, batch):
        rows = []
        for i in range(first, min(jobs, first + batch)):
            start = since + timedelta(seconds=(i // GPUS) * span)
            rows.append((i, start, start + timedelta(seconds=span * 0.95)))
        made = Job.objects.bulk_create(
            Job(
                owner=users[i % USERS],
                group=groups[i % USERS % GROUPS],
                name=f"j{i}",
                command="python train.py --epochs 10",
                workdir="/tmp",
                time_limit_s=86400,
                status=Job.Status.COMPLETED,
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
                outcome=Attempt.Outcome.EXITED,
            )
            for job, (i, start, end) in zip(made, rows, strict=True)
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
                util_gpu_mean=50.0,
            )
            for job, attempt, (i, start, end) in zip(made, attempts, rows, strict=True)
        )
    with connection.cursor() as cursor:
        # A row per record and UTC day it touched, as charging writes them.
        cursor.execute(
            """
            INSERT INTO accounting_dailyusage (record_id, day, user_id, group_id,
                                               job_id, gpu_seconds, busy_gpu_seconds)
            SELECT r.id, d::date, r.user_id, r.group_id, a.job_id,
                   extract(epoch FROM least(r.ended_at, d + interval '1 day')
                                      - greatest(r.started_at, d)),
                   0.5 * extract(epoch FROM least(r.ended_at, d + interval '1 day')
                                            - greatest(r.started_at, d))
            FROM scheduler_usagerecord r
            JOIN scheduler_attempt a ON a.id = r.attempt_id
            CROSS JOIN LATERAL generate_series(
                date_trunc('day', r.started_at AT TIME ZONE 'UTC'),
                date_trunc('day', r.ended_at AT TIME ZONE 'UTC'),
                interval '1 day') d
            """
        )
        cursor.execute("ANALYZE")
    member, other = users[0], users[1]
    log_job = Job.objects.filter(owner=member).order_by("-id").first()
    assert log_job is not None
    attempt = Attempt.objects.get(job=log_job)
    line = "step 1234 loss 0.123456 lr 0.0001 throughput 1234.5 samples/s\n"
    text = (line * (CHUNK // len(line) + 1))[:CHUNK]
    JobLogChunk.objects.bulk_create(
        JobLogChunk(attempt=attempt, node_id=attempt.node_id, offset=o, data=text)
        for o in range(0, settings.GPULAB_LOG_MAX_BYTES, CHUNK)
    )
    return {"member": member, "other": other, "log_job": log_job.pk}


def populated() -> dict[str, Any]:
    """What the requests need, from a database ``populate`` filled earlier."""
    from django.contrib.auth.models import User

    from scheduler.models import JobLogChunk

    chunk = JobLogChunk.objects.select_related("attempt").first()
    assert chunk is not None, "not a database this bench populated"
    return {
        "member": User.objects.get(username="u0"),
        "other": User.objects.get(username="u1"),
        "log_job": chunk.attempt.job_id,
    }


@contextlib.contextmanager
def bench_database(name: str | None, *, keep: bool) -> Iterator[str]:
    """A fresh database, dropped at the end unless ``keep`` (its name printed,
    for ``--database``), or the existing ``name``, left as it is."""
    if name is None and not keep:
        with fresh_database("bounded") as url:
            yield url
        return
    if name is None:
        name = f"bench_bounded_kept_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(_admin_conninfo(os.environ["DATABASE_URL"])) as conn:
            conn.autocommit = True
            conn.execute(f'CREATE DATABASE "{name}"')
    url = _with_db(os.environ["DATABASE_URL"], name)
    setup_django(url)  # migrates: a no-op on a database already migrated
    try:
        yield url
    finally:
        from django.db import connections

        connections.close_all()
        if keep:
            print(f"kept the database: measure again with --database {name}")


def token(user: Any) -> str:
    from portal.api import tokens

    return tokens.create_token(user, "bench", None)[1]


def session_cookie(user: Any) -> str:
    """A signed-in session of ``user`` (as the login form makes one)."""
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.sessions.backends.db import SessionStore

    session = SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = settings.AUTHENTICATION_BACKENDS[0]
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.create()
    return f"{settings.SESSION_COOKIE_NAME}={session.session_key}"


def rss_mib(pid: int) -> float:
    """Resident memory of the process and its children (uvicorn's workers)."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        status = Path(f"/proc/{p}/status").read_text()
        m = re.search(r"VmRSS:\s+(\d+) kB", status)
        total += int(m.group(1)) if m else 0
    return round(total / 1024, 1)


def timed(
    client: httpx.Client, url: str, headers: dict[str, str]
) -> tuple[float, int, int]:
    """(seconds, bytes, status) of one GET, the body read whole."""
    t0 = time.perf_counter()
    size = 0
    with client.stream("GET", url, headers=headers) as response:
        for chunk in response.iter_bytes():
            size += len(chunk)
        status = response.status_code
    return time.perf_counter() - t0, size, status


def others_alone(base: str, headers: dict[str, str], seconds: float) -> dict[str, Any]:
    """The other user's polls with nothing else running: the baseline."""
    polls: dict[str, list[float]] = {"/api/v1/me/": [], "/api/v1/jobs/": []}
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=60) as c:
        while time.monotonic() < deadline:
            for path, times in polls.items():
                times.append(timed(c, path, headers)[0])
    return {
        path: {
            "requests": len(times),
            "p50_ms": round((pct(times, 50) or 0) * 1000, 1),
            "p95_ms": round((pct(times, 95) or 0) * 1000, 1),
        }
        for path, times in polls.items()
    }


def beside(
    base: str,
    url: str,
    member: dict[str, str],
    other: dict[str, str],
    seconds: float,
) -> dict[str, Any]:
    """Four of ``url`` at once from the member, over and over for ``seconds``,
    while the other user polls ``/api/v1/me/`` and ``/api/v1/jobs/`` in turn."""
    stop = threading.Event()
    heavy: list[tuple[float, int]] = []
    polls: dict[str, list[float]] = {"/api/v1/me/": [], "/api/v1/jobs/": []}
    statuses: dict[str, dict[int, int]] = {p: {} for p in polls}

    def hammer() -> None:
        with httpx.Client(base_url=base, timeout=300) as c:
            while not stop.is_set():
                s, _, status = timed(c, url, member)
                heavy.append((s, status))
                if status == 429:
                    # the gate frees the client's place just after the
                    # answer: try again as soon as it has
                    time.sleep(0.05)

    def poll() -> None:
        with httpx.Client(base_url=base, timeout=300) as c:
            while not stop.is_set():
                for path, times in polls.items():
                    s, _, status = timed(c, path, other)
                    times.append(s)
                    statuses[path][status] = statuses[path].get(status, 0) + 1

    load_before = loadavg()
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    threads.append(threading.Thread(target=poll))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    done = [s for s, status in heavy if status == 200]
    return {
        "load_during": [load_before, loadavg()],
        "heavy": {
            "requests": len(heavy),
            "answered_200": len(done),
            "refused_429": sum(1 for _, status in heavy if status == 429),
            "statuses": sorted({s for _, s in heavy}),
            "p50_ms": round((pct(done, 50) or 0) * 1000, 1),
            "max_ms": round(max(done, default=0) * 1000, 1),
        },
        "others": {
            path: {
                "requests": len(times),
                "statuses": statuses[path],
                "p50_ms": round((pct(times, 50) or 0) * 1000, 1),
                "p95_ms": round((pct(times, 95) or 0) * 1000, 1),
                "max_ms": round(max(times, default=0) * 1000, 1),
            }
            for path, times in polls.items()
        },
    }


def variant_env(variant: str) -> dict[str, str]:
    """``NAME=VALUE,NAME=VALUE`` (or ``defaults``) as a dict."""
    if variant in ("", "defaults"):
        return {}
    env = {}
    for item in variant.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("GPULAB_"):
            raise SystemExit(f"--variant {variant!r}: expected GPULAB_NAME=VALUE,...")
        env[name] = value
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the web process (e.g. GPULAB_WEB_API_PER_CLIENT=3)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VALUE,...",
        help="measure the four-at-once phase also with these settings (each in a"
        " web process of its own, on the same data; 'defaults': none); the"
        " first variant (default: 'defaults') also measures the single requests",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants this many times in turn (a shared machine's load"
        " changes: interleaved rounds compare them fairly)",
    )
    parser.add_argument(
        "--costliest",
        default="",
        metavar="TEXT",
        help="run four at once of the first single request whose label holds TEXT"
        " (e.g. 'deep offset', 'CSV') instead of the slowest alone: on a shared"
        " machine the slowest changes from run to run",
    )
    parser.add_argument(
        "--keep-database",
        action="store_true",
        help="keep the populated database at the end (its name is printed)",
    )
    parser.add_argument(
        "--database",
        metavar="NAME",
        help="measure on a database a --keep-database run populated (on"
        " DATABASE_URL's server) instead of populating a fresh one",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    for item in args.env:
        name, _, value = item.partition("=")
        os.environ[name] = value
    variants = args.variant or ["defaults"]
    envs = {v: variant_env(v) for v in variants}
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "machine": machine(),
        "load_start": loadavg(),
        "env": args.env,
        "variants": variants,
        "runs": [],
    }
    with bench_database(args.database, keep=args.keep_database) as db_url:
        from django.conf import settings
        from django.utils import timezone

        t0 = time.perf_counter()
        if args.database:
            made = populated()
            print(f"reusing database {args.database}")
        else:
            made = populate(args.jobs, args.days)
            result["populate_s"] = round(time.perf_counter() - t0, 1)
            print(
                f"populated {args.jobs} jobs over {args.days} days in"
                f" {result['populate_s']} s"
            )
        member_api = {"Authorization": f"Bearer {token(made['member'])}"}
        other_api = {"Authorization": f"Bearer {token(made['other'])}"}
        member_web = {"Cookie": session_cookie(made["member"])}
        today = timezone.now().date()
        first = today - timedelta(settings.GPULAB_USAGE_MAX_DAYS - 1)
        wide = f"from={first}&to={today}"
        page = settings.GPULAB_API_MAX_PAGE
        candidates = {
            "usage API, group, widest range": (
                f"/api/v1/usage/?group=g0&{wide}",
                member_api,
            ),
            "usage API, own, widest range": (f"/api/v1/usage/?{wide}", member_api),
            "usage page, group, widest range": (f"/usage/?group=g0&{wide}", member_web),
            "usage CSV, group, widest range": (
                f"/usage/csv/?group=g0&{wide}",
                member_web,
            ),
            f"job list, limit={page}": (f"/api/v1/jobs/?limit={page}", member_api),
            f"job list, limit={page}, deep offset": (
                f"/api/v1/jobs/?limit={page}&offset=10000",
                member_api,
            ),
            "queue API (first page)": ("/api/v1/queue/", member_api),
            "log tail, biggest": (
                f"/api/v1/jobs/{made['log_job']}/logs/?tail={4 * 1024 * 1024}"
                f"&limit={4 * 1024 * 1024}",
                member_api,
            ),
            "usage API, 0001-01-01..9999-12-31 (refused)": (
                "/api/v1/usage/?from=0001-01-01&to=9999-12-31",
                member_api,
            ),
            "usage CSV, to=9999-12-31 (refused)": (
                "/usage/csv/?to=9999-12-31",
                member_web,
            ),
        }
        log = args.out_dir / "bounded_cost.web.log"
        costliest = ""
        for round_ in range(args.rounds):
            for variant in variants:
                saved = {name: os.environ.get(name) for name in envs[variant]}
                os.environ.update(envs[variant])
                port = free_port()
                server = start_server(db_url, port, log)
                for name, value in saved.items():
                    if value is None:
                        del os.environ[name]
                    else:
                        os.environ[name] = value
                base = f"http://127.0.0.1:{port}"
                run: dict[str, Any] = {"variant": variant, "round": round_ + 1}
                print(f"\n== {variant} (round {round_ + 1} of {args.rounds})")
                try:
                    with httpx.Client(base_url=base, timeout=120) as client:
                        client.get("/api/v1/me/", headers=member_api)  # warm up
                        run["rss_mib_start"] = rss_mib(server.pid)
                        if not costliest:
                            result["alone"] = alone = measure_alone(
                                client, candidates, args.repeat
                            )
                            costliest = max(
                                (k for k, v in alone.items() if v["status"] == 200),
                                key=lambda k: alone[k]["ms"],
                            )
                            if args.costliest:
                                costliest = next(
                                    k for k in candidates if args.costliest in k
                                )
                            result["costliest"] = costliest
                    o = run["others_alone"] = others_alone(
                        base, other_api, args.seconds / 4
                    )
                    print(
                        f"other user alone ({args.seconds / 4:g} s): /api/v1/me/ p50"
                        f" {o['/api/v1/me/']['p50_ms']} ms"
                        f" p95 {o['/api/v1/me/']['p95_ms']} ms, /api/v1/jobs/ p50"
                        f" {o['/api/v1/jobs/']['p50_ms']} ms"
                        f" p95 {o['/api/v1/jobs/']['p95_ms']} ms"
                    )
                    url, headers = candidates[costliest]
                    print(
                        f"four at once of: {costliest} ({url}) for {args.seconds:g} s"
                    )
                    run.update(beside(base, url, headers, other_api, args.seconds))
                    run["rss_mib_end"] = rss_mib(server.pid)
                finally:
                    server.terminate()
                    server.wait(20)
                report(run)
                result["runs"].append(run)
    result["load_end"] = loadavg()
    print(f"\nload: start {result['load_start']}, end {result['load_end']}")
    for run in result["runs"]:
        me, jobs = (
            run["others"][p]["p95_ms"] for p in ("/api/v1/me/", "/api/v1/jobs/")
        )
        met = "met" if max(me, jobs) < GOAL_MS else "NOT met"
        print(
            f"GOAL others' API p95 beside four of {result['costliest']!r}:"
            f" /api/v1/me/ {me:g} ms, /api/v1/jobs/ {jobs:g} ms (goal < {GOAL_MS} ms:"
            f" {met}) [{run['variant']}, round {run['round']};"
            f" p50 beside {_p50s(run['others'])} ms;"
            f" alone p50 {_p50s(run['others_alone'])} ms, p95"
            f" {run['others_alone']['/api/v1/me/']['p95_ms']:g} /"
            f" {run['others_alone']['/api/v1/jobs/']['p95_ms']:g} ms;"
            f" load {run['load_during'][1].split()[0]}]"
        )
    (args.out_dir / "bounded_cost.json").write_text(json.dumps(result, indent=2))
    return 0


def _p50s(others: dict[str, dict[str, Any]]) -> str:
    """ "A / B": the other user's p50 of /api/v1/me/ and of /api/v1/jobs/."""
    return " / ".join(
        f"{others[p]['p50_ms']:g}" for p in ("/api/v1/me/", "/api/v1/jobs/")
    )


def measure_alone(
    client: httpx.Client, candidates: dict[str, tuple[str, dict[str, str]]], repeat: int
) -> dict[str, Any]:
    """Each candidate alone, the median of ``repeat``; printed."""
    alone: dict[str, Any] = {}
    print(f"alone (median of {repeat}):")
    for label, (url, headers) in candidates.items():
        runs = [timed(client, url, headers) for _ in range(repeat)]
        ms = statistics.median(r[0] for r in runs) * 1000
        alone[label] = {
            "url": url,
            "status": runs[-1][2],
            "ms": round(ms, 1),
            "bytes": runs[-1][1],
        }
        print(f"  {label:48} {runs[-1][2]}  {ms:8.1f} ms  {runs[-1][1]:>10,} bytes")
    return alone


def report(run: dict[str, Any]) -> None:
    h = run["heavy"]
    print(
        f"  member's requests: {h['answered_200']} answered (p50"
        f" {h['p50_ms']} ms, max {h['max_ms']} ms), {h['refused_429']}"
        " refused 429 by the per-client cap and tried again"
    )
    for path, o in run["others"].items():
        print(
            f"  other user {path:16} n={o['requests']:4} {o['statuses']}"
            f"  p50 {o['p50_ms']} ms  p95 {o['p95_ms']} ms  max {o['max_ms']} ms"
        )
    print(
        f"  web RSS: {run['rss_mib_start']} MiB at start, {run['rss_mib_end']} after"
        f" the concurrent ones; load {run['load_during']}"
    )


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    sys.exit(main())
