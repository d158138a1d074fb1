"""What one page of the job list costs the machine, by depth: CPU time of the web
thread that answers it and of the PostgreSQL backend that serves its queries
(issue #27: a member's deep 1,000-job page was the costliest request, and what it
costs is what other users' calls share the two cores with).

On ``bench/bounded_cost.py``'s data (``--database``: a database its
``--keep-database`` run populated; else populated afresh and dropped): 100,000
jobs, the member ``u0`` leading group ``g0`` (12,500 jobs), ``admin`` (staff,
created here if missing) seeing all. In this process, through Django's test
client (no HTTP, no gate: the request's own cost), each page in turn,
``--repeat`` times, the medians printed:

- the member's 1,000-job page at offset 0, at offset 10,000, and from a cursor
  (``before``) at the same depth;
- staff's 1,000-job page at offset 0, near the end (``offset`` = all but one
  page), and from a cursor at that depth;
- another user's default page (100 of their 2,500 jobs).

CPU time is the thread's (``time.thread_time``; "a row": that over the page's
items) and the backend's (its ``/proc/PID/stat`` user + system ticks, 10 ms
each: a median of several rounds smooths them); wall time is printed too but moves with the machine's load, CPU
time much less. Run ``python -m portal.stack.run -- python bench/job_page_cost.py
--database NAME`` (the name ``bounded_cost.py --keep-database`` printed); from an
older checkout of the code the same command measures it before a change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounded_cost import bench_database, populate
from real_stack import loadavg

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def backend_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (the PostgreSQL backend)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database",
        metavar="NAME",
        help="a database bench/bounded_cost.py --keep-database populated; without"
        " it, a fresh one is populated as that bench does (minutes) and dropped",
    )
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "127.0.0.1")
    with bench_database(args.database, keep=False):
        if not args.database:
            populate(args.jobs, 365)
        measure(args.repeat)
    return 0


def measure(repeat: int) -> None:
    """Each page ``repeat`` times in turn; the medians printed."""
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client

    from portal.api import tokens
    from scheduler.models import Job

    admin, _ = User.objects.get_or_create(username="admin", defaults={"is_staff": True})

    def bearer(username: str) -> dict[str, str]:
        user = User.objects.get(username=username)
        return {"Authorization": f"Bearer {tokens.create_token(user, 'b', None)[1]}"}

    member, other, staff = bearer("u0"), bearer("u1"), bearer(admin.username)
    client = Client(HTTP_HOST="127.0.0.1")
    member_ids = list(
        Job.objects.visible_to(User.objects.get(username="u0"))
        .order_by("-id")
        .values_list("pk", flat=True)[9999:10000]
    )
    total = Job.objects.count()
    deep = total - 1000
    staff_cursor = Job.objects.order_by("-id").values_list("pk", flat=True)[deep - 1]
    cases: dict[str, tuple[str, dict[str, str]]] = {
        "member, 1000 at offset 0": ("/api/v1/jobs/?limit=1000", member),
        "member, 1000 at offset 10000": (
            "/api/v1/jobs/?limit=1000&offset=10000",
            member,
        ),
        "member, 1000 from a cursor at 10000": (
            f"/api/v1/jobs/?limit=1000&before={member_ids[0]}",
            member,
        ),
        "staff, 1000 at offset 0": ("/api/v1/jobs/?limit=1000", staff),
        f"staff, 1000 at offset {deep}": (
            f"/api/v1/jobs/?limit=1000&offset={deep}",
            staff,
        ),
        f"staff, 1000 from a cursor at {deep}": (
            f"/api/v1/jobs/?limit=1000&before={staff_cursor}",
            staff,
        ),
        "another user, 100 at offset 0": ("/api/v1/jobs/", other),
    }
    for _url, headers in cases.values():  # stamp the tokens, warm the caches
        client.get("/api/v1/me/", headers=headers)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cases}
    rows: dict[str, int] = {}  # items on each page
    for _ in range(repeat):
        for label, (url, headers) in cases.items():
            wall, cpu, pg = time.perf_counter(), time.thread_time(), backend_cpu_s(pid)
            got = client.get(url, headers=headers)
            assert got.status_code == 200, (url, got.status_code)
            rows.setdefault(label, len(got.json()["results"]))
            times[label].append(
                (
                    time.perf_counter() - wall,
                    time.thread_time() - cpu,
                    backend_cpu_s(pid) - pg,
                )
            )
    print(f"{total} jobs; median of {repeat}; load {loadavg()}")
    print(f"{'page':42} {'web CPU':>9} {'a row':>9} {'PG CPU':>8} {'wall':>9}")
    for label, runs in times.items():
        web, pg, wall = (
            statistics.median(r[i] for r in runs) * 1000 for i in (1, 2, 0)
        )
        per_row = web / max(1, rows[label])
        print(f"{label:42} {web:6.0f} ms {per_row:6.3f} ms {pg:5.0f} ms {wall:6.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
