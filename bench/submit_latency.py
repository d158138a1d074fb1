"""Submit-to-start latency on an idle cluster: from the HTTP POST of a
job to the moment its process runs on the agent.

A fresh database and ``make up``'s processes on it (``bench/real_stack.py``: web,
worker, notifier, beat and ``--cluster`` simulated agents, default
``2x4:A100-80GB``, the demo cluster). One user with an API token submits
``--jobs`` (200) one-GPU jobs one at a time through ``POST /api/v1/jobs/``
(httpx, one keep-alive connection); each job's command is
``date +%s.%N > <dir>/<n>``: the process's own clock says when it ran (same
machine, same clock as the client's). The next job is submitted once the
previous one has ended (the cluster is idle for each). ``--warmup`` jobs first
are not counted. ``--history N`` first fills the database with N completed
jobs of other users (the history a run-time prediction reads at submit).

Latency = the marker's time minus the time the POST was sent: p50 / p95 / p99 /
max. Where the time goes, per job, from the processes' own timestamps:

- ``request``: POST sent -> the job row's ``submitted_at`` (parse, auth, rate
  limit, validation, runtime prediction);
- ``to_pass``: ``submitted_at`` -> the worker's "Task schedule_pass received"
  (commit, ``on_commit`` enqueue, Redis, the worker taking it);
- ``pass``: received -> the job's STARTING event (the pass's snapshot,
  decide, start up to the event);
- ``to_agent``: STARTING event -> the agent's "launching" log line (the rest of
  the pass's transaction, commit, ``job.launch`` over the channel layer, the
  agent's websocket);
- ``spawn``: the agent's "launching" -> the marker (the job's shim, a Python
  process, then the shell running the command);
- and, beside them, ``post``: POST sent -> response received.

Prints the figures and writes ``<out-dir>/submit_latency.json``. Run:
``DATABASE_URL=... REDIS_URL=... python bench/submit_latency.py``
(or through ``make bench``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_stack import (
    ROOT,
    fresh_database,
    loadavg,
    log_time,
    machine,
    pct,
    real_stack,
)

STAGES = ("request", "to_pass", "pass", "to_agent", "spawn")


def make_user() -> str:
    from django.contrib.auth.models import User

    from portal.api import tokens

    user = User.objects.create_user("bench-latency", password="bench-pw-1")
    return tokens.create_token(user, "bench", None)[1]


def fill_history(jobs: int) -> None:
    """``jobs`` completed jobs of other users (``bounded_cost.populate``), on
    nodes marked lost with their GPUs absent, so that the passes place the
    measured jobs on the stack's own agents only."""
    from bounded_cost import populate

    from scheduler.models import Gpu, Node

    populate(jobs, 365)
    Node.objects.update(status=Node.Status.LOST)
    Gpu.objects.update(present=False)


def wait_file(path: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = ""
        if text.endswith("\n"):
            return text
        time.sleep(0.002)
    raise RuntimeError(f"{path} not written within {timeout} s")


def wait_ended(job_id: int, timeout: float = 60.0) -> str:
    from scheduler.models import Job

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Job.objects.values_list("status", flat=True).get(pk=job_id)
        if status in {"completed", "failed", "cancelled", "timeout"}:
            return str(status)
        time.sleep(0.01)
    raise RuntimeError(f"job {job_id} did not end within {timeout} s")


def submit_all(
    base_url: str, token: str, markers: Path, count: int
) -> list[dict[str, Any]]:
    rows = []
    with httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    ) as client:
        for n in range(count):
            marker = markers / str(n)
            body = {
                "name": f"lat-{n}",
                "command": f"date +%s.%N > {marker}",
                "workdir": "/tmp",
                "gpus": 1,
            }
            t_send = time.time()
            resp = client.post("/api/v1/jobs/", json=body)
            t_resp = time.time()
            if resp.status_code != 201:
                raise RuntimeError(f"POST: {resp.status_code} {resp.text[:300]}")
            job_id = resp.json()["id"]
            started = float(wait_file(marker))
            status = wait_ended(job_id)
            rows.append(
                {
                    "job": job_id,
                    "send": t_send,
                    "resp": t_resp,
                    "process": started,
                    "status": status,
                }
            )
    return rows


def annotate(rows: list[dict[str, Any]], stack: Any) -> list[dict[str, Any]]:
    """Add the server-side timestamps (database rows, the processes' logs)."""
    from scheduler.models import Attempt, Job, JobEvent

    ids = [r["job"] for r in rows]
    submitted = dict(Job.objects.filter(pk__in=ids).values_list("pk", "submitted_at"))
    starting = dict(
        JobEvent.objects.filter(job_id__in=ids, to_status="starting")
        .order_by("at")
        .values_list("job_id", "at")
    )
    attempts = {a.job_id: a for a in Attempt.objects.filter(job_id__in=ids, number=1)}
    received = sorted(
        t
        for line in stack.procs["worker"].matching(
            r"Task scheduler\.tasks\.schedule_pass\[.*\] received"
        )
        if (t := log_time(line[1])) is not None
    )
    launching: dict[int, float] = {}
    for name, proc in stack.procs.items():
        if not name.startswith("demo-"):
            continue
        for _, line in proc.matching(r"attempt \d+ \(job \d+, .*\): launching"):
            m = re.search(r"attempt \d+ \(job (\d+),", line)
            t = log_time(line)
            if m and t is not None:
                launching[int(m.group(1))] = t
    for r in rows:
        job = r["job"]
        sub = submitted[job].timestamp()
        start_ev = starting[job].timestamp()
        # The pass that started it: the last one received before its start.
        before = [t for t in received if sub - 0.002 <= t <= start_ev]
        pass_recv = before[-1] if before else None
        agent = launching.get(job)
        attempt = attempts.get(job)
        r.update(
            {
                "submitted_at": sub,
                "starting_at": start_ev,
                "pass_received": pass_recv,
                "agent_launching": agent,
                "agent_started_at": attempt.started_at.timestamp()
                if attempt and attempt.started_at
                else None,
                "latency": r["process"] - r["send"],
                "post": r["resp"] - r["send"],
                "request": sub - r["send"],
                "to_pass": None if pass_recv is None else pass_recv - sub,
                "pass": None if pass_recv is None else start_ev - pass_recv,
                # No pass received in between: another pass looped for it.
                "to_start_event": start_ev - sub,
                "to_agent": None if agent is None else agent - start_ev,
                "spawn": None if agent is None else r["process"] - agent,
            }
        )
    return rows


def passes_ms(stack: Any) -> list[float]:
    out = []
    for _, line in stack.procs["worker"].matching(r"schedule pass: \{"):
        out += [float(x) for x in re.findall(r"'ms': ([\d.]+)", line)]
    return out


def summary(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50_ms": _r(pct(ms, 50)),
        "p95_ms": _r(pct(ms, 95)),
        "p99_ms": _r(pct(ms, 99)),
        "max_ms": _r(max(ms, default=None)),
        "mean_ms": _r(sum(ms) / len(ms) if ms else None),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cluster", default="2x4:A100-80GB")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        help="NAME=VALUE for the stack's processes (e.g. to try a setting)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="N",
        help="first fill the database with N completed jobs of 40 other users over"
        " a year (bounded_cost.populate: 24 h limits, the default limit, so"
        " GPULAB_PREDICTION=pools reads that pool's runs), on nodes left lost",
    )
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    result: dict[str, Any] = {
        "machine": machine(),
        "load_start": loadavg(),
        "jobs": args.jobs,
        "cluster": args.cluster,
        "env": extra_env,
        "history": args.history,
    }
    print(f"machine: {result['machine']}; load average at start: {loadavg()}")
    with (
        tempfile.TemporaryDirectory(prefix="gpl-lat-") as tmp,
        fresh_database("latency") as db_url,
    ):
        if args.history:
            t_fill = time.monotonic()
            fill_history(args.history)
            result["history_fill_s"] = round(time.monotonic() - t_fill, 1)
            print(
                f"filled {args.history} completed jobs in {result['history_fill_s']} s"
            )
        token = make_user()
        state = Path(tmp)
        markers = state / "markers"
        markers.mkdir()
        markers.chmod(0o777)
        with real_stack(db_url, state, args.cluster, extra_env) as stack:
            (markers / "w").mkdir()
            submit_all(stack.base_url, token, markers / "w", args.warmup)
            t0 = time.monotonic()
            rows = submit_all(stack.base_url, token, markers, args.jobs)
            wall = time.monotonic() - t0
            rows = annotate(rows, stack)
            pass_ms = passes_ms(stack)
    result["load_end"] = loadavg()
    result["wall_s"] = round(wall, 1)
    result["statuses"] = sorted({r["status"] for r in rows})
    result["latency"] = summary([r["latency"] for r in rows])
    result["post"] = summary([r["post"] for r in rows])
    result["stages"] = {
        s: summary([r[s] for r in rows if r[s] is not None]) for s in STAGES
    }
    result["to_start_event"] = summary([r["to_start_event"] for r in rows])
    result["passes_that_started_ms"] = summary([m / 1000 for m in pass_ms])
    result["agent_started_at_minus_marker"] = summary(
        [r["agent_started_at"] - r["process"] for r in rows if r["agent_started_at"]]
    )
    result["rows"] = rows

    lat = result["latency"]
    print(
        f"{args.jobs} jobs on {args.cluster}, one at a time ({wall:.0f} s): "
        f"submit -> process started p50 {lat['p50_ms']} ms, p95 {lat['p95_ms']} ms, "
        f"p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms "
        f"(goal: p50 < 250 ms, p99 < 1000 ms)"
    )
    post = result["post"]
    print(f"  POST response        p50 {post['p50_ms']:7} ms  p99 {post['p99_ms']} ms")
    for s in STAGES:
        f = result["stages"][s]
        print(
            f"  {s:20} p50 {f['p50_ms']!s:>7} ms  p95 {f['p95_ms']!s:>7} ms  "
            f"p99 {f['p99_ms']!s:>7} ms  mean {f['mean_ms']} ms  (n={f['n']})"
        )
    f = result["passes_that_started_ms"]
    print(f"  passes that started a job: {f['n']}, p50 {f['p50_ms']} ms (pass 'ms')")
    print(f"  job statuses: {result['statuses']}")
    print(f"load average: start {result['load_start']}  end {result['load_end']}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "submit_latency.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
