"""What cancelling a job array costs, by the array's size (issue #27, "Hostile
input and bounded cost").

A fresh, migrated database, one node of 8 GPUs (no agent: nothing starts) and
one member (group ``vision``, an API token). For
each ``--sizes`` (10, 200, 1,000 waiting tasks), ``--rounds`` times:

1. an array of that many PENDING tasks (``services.submit_array``), cancelled in
   this process by ``services.cancel_array``: its wall time and the number of
   SQL queries it made (the after-commit work included: Channels sends, the
   queue mark, the pass request, the notifications' outbox);
2. another such array, cancelled over HTTP through the web process exactly as
   ``make up`` runs it (uvicorn; ``POST /api/v1/arrays/<id>/cancel/`` with the
   token): the request's wall time.

Prints each figure (median and max over the rounds) with the machine's load and
writes ``<out-dir>/array_cancel.json``. Nothing runs the scheduling pass (no
worker): the tasks stay PENDING until cancelled.

Run: ``python -m portal.stack.run -- python bench/array_cancel.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from live_dashboard import start_server  # noqa: E402
from real_stack import free_port, fresh_database, loadavg, machine  # noqa: E402


def member() -> tuple[Any, str]:
    from django.contrib.auth.models import User

    from portal.api import tokens
    from scheduler.models import Group, Membership
    from tests.conftest import make_node

    make_node("node-a", 8)  # a submission needs a GPU node to exist
    vision = Group.objects.create(name="vision")
    alice = User.objects.create_user("alice", "alice@lab.example", "pw-alice")
    Membership.objects.create(user=alice, group=vision)
    return alice, tokens.create_token(alice, "bench", None)[1]


def new_array(owner: Any, size: int) -> int:
    from scheduler import services

    req = services.JobRequest(
        name="sweep", command="python sweep.py", workdir="/tmp/w", group="vision"
    )
    return services.submit_array(owner, req, f"0-{size - 1}").pk


def in_process(owner: Any, size: int) -> dict[str, float]:
    from django.db import connection

    from scheduler import services

    array_id = new_array(owner, size)
    queries = 0

    def count(execute: Any, *args: Any) -> Any:
        nonlocal queries
        queries += 1
        return execute(*args)

    with connection.execute_wrapper(count):
        started = time.perf_counter()
        cancelled = services.cancel_array(array_id, by=owner)
        wall = time.perf_counter() - started
    assert len(cancelled) == size, (len(cancelled), size)
    return {"wall_s": wall, "queries": queries}


def over_http(owner: Any, client: httpx.Client, size: int) -> float:
    array_id = new_array(owner, size)
    started = time.perf_counter()
    response = client.post(f"/api/v1/arrays/{array_id}/cancel/")
    wall = time.perf_counter() - started
    response.raise_for_status()
    assert len(response.json()["cancelled"]) == size
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,200,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    load_before = loadavg()
    rows: list[dict[str, Any]] = []
    with (
        fresh_database("array_cancel") as db_url,
        tempfile.TemporaryDirectory(prefix="gpl-array-cancel-") as tmp,
    ):
        owner, secret = member()
        port = free_port()
        web = start_server(db_url, port, Path(tmp) / "web.log")
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {secret}"},
                timeout=120,
            ) as client:
                for size in sizes:
                    runs = [in_process(owner, size) for _ in range(args.rounds)]
                    http = [over_http(owner, client, size) for _ in range(args.rounds)]
                    walls = [r["wall_s"] for r in runs]
                    rows.append(
                        {
                            "tasks": size,
                            "queries": [int(r["queries"]) for r in runs],
                            "service_s_median": round(statistics.median(walls), 3),
                            "service_s_max": round(max(walls), 3),
                            "http_s_median": round(statistics.median(http), 3),
                            "http_s_max": round(max(http), 3),
                            "load": loadavg(),
                        }
                    )
                    row = rows[-1]
                    print(
                        f"{size:>6} tasks: cancel_array {row['service_s_median']} s"
                        f" (max {row['service_s_max']}), queries {row['queries']};"
                        f" POST .../cancel/ {row['http_s_median']} s"
                        f" (max {row['http_s_max']}); load {row['load']}",
                        flush=True,
                    )
        finally:
            web.terminate()
            web.wait(timeout=30)
    report = {
        "rounds": args.rounds,
        "rows": rows,
        "load_before": load_before,
        "load_after": loadavg(),
        "machine": machine(),
    }
    print(f"load before {load_before}; after {report['load_after']}")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "array_cancel.json").write_text(
            json.dumps(report, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
