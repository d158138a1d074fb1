"""Interactive job requested -> JupyterLab usable through the portal, on an idle
demo cluster, and where the time goes.

A fresh database and ``make up``'s processes on it (``bench/real_stack.py``: web,
worker, notifier, beat and ``--cluster`` simulated agents, default
``2x4:A100-80GB``), the agents finding this venv's ``jupyter`` on their PATH and
binding it to loopback. One user (a Unix account of its own: JupyterLab never
runs as root; ``tests.interactive.accounts``) signed in through the login form;
``--runs`` (10) times, one after another: ``POST /api/v1/jobs/`` with
``{"interactive": "jupyter"}``, then poll through the portal's proxy (every
20 ms) until ``/interactive/<id>/lab`` and ``/interactive/<id>/api/kernelspecs``
both answer 200: JupyterLab's page and its API are usable. Then the job is
cancelled and its end awaited (one interactive job per user).

Per run: ``total`` = usable - POST sent; ``queue_launch`` = the job's process
started (``Attempt.started_at``, the agent's clock) - POST sent: the portal,
the pass and the agent; ``jupyter`` = usable - the process started:
JupyterLab's own start, plus at most one poll. Prints p50 / p95 / max and
writes ``<out-dir>/interactive_start.json``. Run as root (it creates the
account): ``python -m portal.stack.run -- python bench/interactive_start.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_stack import (
    ROOT,
    bench_record,
    interactive_stack,
    is_root,
    loadavg,
    pct,
    signed_in,
)

if TYPE_CHECKING:
    import httpx

POLL_S = 0.02
PASSWORD = "bench-pw-1"


def make_user(account: str) -> str:
    from django.contrib.auth.models import User

    from portal.api import tokens
    from scheduler.models import Profile

    user = User.objects.create_user("bench-lab", password=PASSWORD)
    Profile.objects.update_or_create(user=user, defaults={"unix_account": account})
    return tokens.create_token(user, "bench", None)[1]


def started_at(job_id: int) -> float | None:
    from django.db import connections

    from scheduler.models import Attempt

    try:
        got = (
            Attempt.objects.filter(job_id=job_id, started_at__isnull=False)
            .values_list("started_at", flat=True)
            .first()
        )
    finally:
        connections.close_all()
    return None if got is None else got.timestamp()


def one_run(api: httpx.Client, browser: httpx.Client) -> dict[str, Any]:
    t_send = time.time()
    resp = api.post("/api/v1/jobs/", json={"interactive": "jupyter", "workdir": "/tmp"})
    if resp.status_code != 201:
        raise RuntimeError(f"POST: {resp.status_code} {resp.text[:300]}")
    job_id = resp.json()["id"]
    base = f"/interactive/{job_id}/"
    deadline = time.monotonic() + 120
    while True:
        lab = browser.get(base + "lab")
        if lab.status_code == 200:
            specs = browser.get(base + "api/kernelspecs")
            if specs.status_code == 200:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id}: not usable in 120 s ({lab.status_code})")
        time.sleep(POLL_S)
    t_usable = time.time()
    t_started = started_at(job_id)
    cancel = api.post(f"/api/v1/jobs/{job_id}/cancel/")
    if cancel.status_code != 200:
        raise RuntimeError(f"cancel: {cancel.status_code} {cancel.text[:200]}")
    while api.get(f"/api/v1/jobs/{job_id}/").json()["state"] != "cancelled":
        time.sleep(0.05)
    return {
        "job": job_id,
        "total": t_usable - t_send,
        "queue_launch": None if t_started is None else t_started - t_send,
        "jupyter": None if t_started is None else t_usable - t_started,
    }


def summary(values: list[float | None]) -> dict[str, float | None]:
    ms = [v * 1000 for v in values if v is not None]
    return {
        "n": len(ms),
        "p50_ms": _r(pct(ms, 50)),
        "p95_ms": _r(pct(ms, 95)),
        "max_ms": _r(max(ms, default=None)),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cluster", default="2x4:A100-80GB")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not is_root():
        return 1
    result = bench_record(runs=args.runs, cluster=args.cluster)
    with (
        interactive_stack("interactive", args.cluster, make_user) as lab,
        signed_in(lab.stack.base_url, "bench-lab", PASSWORD) as browser,
    ):
        rows = [one_run(lab.api, browser) for _ in range(args.runs)]
    result["load_end"] = loadavg()
    result["rows"] = rows
    for key in ("total", "queue_launch", "jupyter"):
        result[key] = summary([r[key] for r in rows])
        s = result[key]
        print(
            f"{key:>13}: p50 {s['p50_ms']} ms, p95 {s['p95_ms']} ms,"
            f" max {s['max_ms']} ms (n={s['n']})"
        )
    print(f"load average at end: {result['load_end']}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interactive_start.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
