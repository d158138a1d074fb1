"""Submission burst: ``--jobs`` (10,000) jobs submitted through the API
in ``--seconds`` (60) by ``--users`` (50) users under the default rate limits,
while a signed-in user keeps loading the web pages.

A fresh database and ``make up``'s processes on it (``bench/real_stack.py``: web,
worker, notifier, beat and ``--cluster`` simulated agents, default
``2x4:A100-80GB``). Each user has an API token. The submissions' send times are
spread evenly over the window (open loop: a slow answer does not delay the next
send); each goes to a user drawn from a Zipf law of exponent ``--skew`` (0: every
user submits the same number, 200 each; 1: the busiest user submits about a
fifth). Every job is a one-GPU ``true`` (it ends at once). asyncio + httpx, one
client per user.

- Answers: 201, 429 (each checked for a ``Retry-After`` header of whole seconds
  and the ``{"error": "throttled", ...}`` body), 503 (the server out of
  capacity, with its Retry-After), other. With ``--retries N`` (3) a submission
  answered 429 or 503 is sent again after its Retry-After, at most N times:
  "accepted at first try" and "accepted in the end" are both reported.
- Scheduled: after the burst, every accepted job must, within ``--settle`` s,
  have been started (starting, running or ended) or be pending with a queue
  position and a reason from a pass (not the submit's "waiting for the
  scheduler"). The figures: how many of each, how many never got there, and when
  the last one did.
- Pages: meanwhile one user (the first, logged in through the login form) loads
  ``/``, ``/queue/`` and ``/jobs/`` in turn, one at a time, from a process of its
  own (as a person's browser would: timed from the load generator's own event
  loop, a page's time would be mostly that loop's backlog): p50 / p95 / max per page
  before the burst (idle), during it (goal: p95 < 500 ms), and for
  ``--after-pages`` s after it, with the burst's jobs stored.
- The load generator's own CPU, as a share of one core over the burst.
- ``--profile``: py-spy (a dev dependency: ``make venv`` installs it) samples
  the web process and the worker (with its pool children) during the burst,
  non-blocking; the top functions by own time and by total time are printed.

Prints the figures and writes ``<out-dir>/submit_burst.json``. Run:
``DATABASE_URL=... REDIS_URL=... python bench/submit_burst.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import multiprocessing
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_stack import ROOT, fresh_database, loadavg, machine, pct, real_stack

PAGES = ("/", "/queue/", "/jobs/")


def make_users(count: int) -> list[dict[str, Any]]:
    from django.contrib.auth.models import User

    from portal.api import tokens

    users = []
    for i in range(count):
        user = User.objects.create_user(f"burst-{i:02d}", password="bench-pw-1")
        users.append(
            {"name": user.username, "token": tokens.create_token(user, "b", None)[1]}
        )
    return users


def plan(jobs: int, users: int, seconds: float, skew: float) -> list[tuple[float, int]]:
    """(send offset in s, user index) for each submission."""
    rng = random.Random(9)
    weights = [1 / (i + 1) ** skew for i in range(users)]
    if skew == 0:
        who = [i % users for i in range(jobs)]
        rng.shuffle(who)
    else:
        who = rng.choices(range(users), weights=weights, k=jobs)
    return [(i * seconds / jobs, who[i]) for i in range(jobs)]


# ------------------------------------------------------------------ submitters


async def submit_one(
    client: httpx.AsyncClient, n: int, retries: int, rec: dict[str, Any]
) -> None:
    body = {"name": f"burst-{n}", "command": "true", "workdir": "/tmp", "gpus": 1}
    for attempt in range(retries + 1):
        t0 = time.time()
        try:
            resp = await client.post("/api/v1/jobs/", json=body)
        except httpx.HTTPError as exc:
            rec["answers"].append((t0, time.time(), attempt, f"error {type(exc)}"))
            return
        t1 = time.time()
        code = resp.status_code
        rec["answers"].append((t0, t1, attempt, code))
        if code == 201:
            rec["accepted"].append((resp.json()["id"], attempt, t1))
            return
        after = resp.headers.get("Retry-After", "")
        if code == 503:  # the server shedding load or out of database connections
            rec["unavailable"].append((after, resp.text[:200]))
            if attempt < retries and after.isdigit():
                await asyncio.sleep(int(after))
                continue
            return
        if code != 429:
            rec["other"].append((code, resp.text[:200]))
            return
        try:
            payload = resp.json()
        except ValueError:
            payload = {}
        ok = (
            after.isdigit()
            and int(after) >= 1
            and payload.get("error") == "throttled"
            and f"try again in {after} s" in str(payload.get("detail", ""))
        )
        rec["throttled"].append((after, ok))
        if attempt < retries and after.isdigit():
            await asyncio.sleep(int(after))


async def burst(
    base_url: str,
    users: list[dict[str, Any]],
    schedule: list[tuple[float, int]],
    retries: int,
    rec: dict[str, Any],
) -> None:
    clients = [
        httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {u['token']}"},
            timeout=httpx.Timeout(300.0, pool=None),
            limits=httpx.Limits(max_connections=20),
        )
        for u in users
    ]
    tasks = []
    start = time.monotonic()
    rec["burst_start"] = time.time()
    for n, (offset, who) in enumerate(schedule):
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(submit_one(clients[who], n, retries, rec)))
    rec["sends_done"] = time.time()
    await asyncio.gather(*tasks)
    rec["burst_end"] = time.time()
    for c in clients:
        await c.aclose()


async def browse(
    base_url: str,
    user: str,
    stop: Any,
    out: list[tuple[float, str, float, int]],
) -> None:
    async with httpx.AsyncClient(
        base_url=base_url, timeout=120, follow_redirects=False
    ) as client:
        page = await client.get("/accounts/login/")
        page.raise_for_status()
        resp = await client.post(
            "/accounts/login/",
            data={
                "username": user,
                "password": "bench-pw-1",
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
            },
        )
        if resp.status_code != 302:
            raise RuntimeError(f"login failed: {resp.status_code}")
        while not stop.is_set():
            for url in PAGES:
                t0 = time.time()
                try:
                    code = (await client.get(url)).status_code
                except httpx.HTTPError:
                    code = -1
                t1 = time.time()
                out.append((t0, url, (t1 - t0) * 1000, code))


def browser_process(base_url: str, user: str, stop: Any, result: Any) -> None:
    """The signed-in user's page loads, in a process of its own: a person's browser
    does not share the load generator's event loop, whose backlog (thousands of
    submissions and retries) would otherwise be timed as the pages' own."""
    out: list[tuple[float, str, float, int]] = []
    asyncio.run(browse(base_url, user, stop, out))
    result.put(out)


# ------------------------------------------------------------------ settling


def scheduled_state(ids: list[int]) -> dict[str, int]:
    from scheduler.models import Job

    counts: collections.Counter[str] = collections.Counter()
    for status, position, message in Job.objects.filter(pk__in=ids).values_list(
        "status", "queue_order", "pending_message"
    ):
        if status != "pending":
            counts["started_or_ended" if status != "held" else "held"] += 1
        elif position is not None and message != "waiting for the scheduler":
            counts["queued_with_reason"] += 1
        else:
            counts["not_yet_seen_by_a_pass"] += 1
    counts["missing"] = len(ids) - sum(counts.values())
    return dict(counts)


def settle(ids: list[int], timeout: float) -> tuple[dict[str, int], float | None]:
    t0 = time.monotonic()
    while True:
        state = scheduled_state(ids)
        if not state.get("not_yet_seen_by_a_pass") and not state.get("missing"):
            return state, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return state, None
        time.sleep(1.0)


def statuses(ids: list[int]) -> dict[str, int]:
    from django.db.models import Count

    from scheduler.models import Job

    rows = Job.objects.filter(pk__in=ids).values("status").annotate(n=Count("id"))
    return {r["status"]: r["n"] for r in rows}


# ------------------------------------------------------------------ profile


def start_profiles(
    stack: Any,
    out: Path,
    seconds: int,
    names: tuple[str, ...] = ("web", "worker"),
    suffix: str = "",
) -> list[subprocess.Popen[bytes]]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not installed: no profile")
        return []
    procs = []
    for name in names:
        extra = ["--subprocesses"] if name == "worker" else []
        pid = stack.procs[name].popen.pid
        argv = [
            spy, "record", "--pid", str(pid), "--duration", str(seconds),
            "--rate", "50", "--nonblocking", "--format", "raw",
            "--output", str(out / f"{name}{suffix}.folded"), *extra,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    return procs


def summarize_folded(path: Path, top: int = 15) -> dict[str, Any]:
    """Own and total sample counts per function from py-spy's raw output."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [_short(f) for f in stack.split(";")]
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            total[f] += n
    project = [
        (f, n)
        for f, n in total.most_common()
        if re.search(r"\((portal|scheduler|agents)/", f)
    ]
    return {
        "samples": samples,
        "own": [(f, n, round(100 * n / samples, 1)) for f, n in own.most_common(top)],
        "total_project": [
            (f, n, round(100 * n / samples, 1)) for f, n in project[:top]
        ],
    }


def _short(frame: str) -> str:
    # "func (path/to/site-packages/pkg/mod.py:12)" -> "func (pkg/mod.py)"
    m = re.match(r"(.*) \((.*?):?\d*\)$", frame)
    if not m:
        return frame
    func, path = m.groups()
    path = re.sub(r".*/site-packages/", "", path)
    path = re.sub(r".*/wt-[^/]+/", "", path)
    path = re.sub(r".*/lib/python3\.\d+/", "", path)
    return f"{func} ({path})"


# ------------------------------------------------------------------ main


def summary(values: list[float]) -> dict[str, float | None]:
    return {
        "n": len(values),
        "p50_ms": _r(pct(values, 50)),
        "p95_ms": _r(pct(values, 95)),
        "p99_ms": _r(pct(values, 99)),
        "max_ms": _r(max(values, default=None)),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


async def run(
    stack: Any, users: list[dict[str, Any]], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    mp = multiprocessing.get_context("spawn")
    stop = mp.Event()
    pages_out = mp.Queue()
    browser = mp.Process(
        target=browser_process,
        args=(stack.base_url, users[0]["name"], stop, pages_out),
        daemon=True,
    )
    browser.start()
    cpu0 = time.process_time()
    await asyncio.sleep(args.idle_pages)  # the pages on an idle portal first
    rec: dict[str, Any] = {
        "answers": [],
        "accepted": [],
        "throttled": [],
        "unavailable": [],
        "other": [],
    }
    schedule = plan(args.jobs, len(users), args.seconds, args.skew)
    spies = start_profiles(stack, tmp, int(args.seconds)) if args.profile else []
    await burst(stack.base_url, users, schedule, args.retries, rec)
    for spy in spies:
        spy.wait(60)
    if args.profile:  # the web process while only the pages load
        spies = start_profiles(stack, tmp, int(args.after_pages), ("web",), "-after")
    rec["generator_cpu_s"] = time.process_time() - cpu0
    await asyncio.sleep(args.after_pages)  # the pages with the burst's jobs stored
    stop.set()
    pages = await asyncio.to_thread(pages_out.get, timeout=300)
    browser.join(30)
    for spy in spies:
        spy.wait(60)
    rec["pages"] = pages
    rec["schedule_per_user"] = collections.Counter(who for _, who in schedule)
    return rec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--settle", type=float, default=300.0)
    parser.add_argument("--idle-pages", type=float, default=10.0)
    parser.add_argument("--after-pages", type=float, default=15.0)
    parser.add_argument("--cluster", default="2x4:A100-80GB")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    result: dict[str, Any] = {
        "machine": machine(),
        "load_start": loadavg(),
        "args": {k: v for k, v in vars(args).items() if k != "out_dir"},
    }
    print(f"machine: {result['machine']}; load average at start: {loadavg()}")
    with (
        tempfile.TemporaryDirectory(prefix="gpl-burst-") as tmp_name,
        fresh_database("burst") as db_url,
    ):
        tmp = Path(tmp_name)
        users = make_users(args.users)
        with real_stack(db_url, tmp, args.cluster, extra_env) as stack:
            rec = asyncio.run(run(stack, users, args, tmp))
            result["load_after_burst"] = loadavg()
            ids = [job for job, _, _ in rec["accepted"]]
            t_settle = time.monotonic()
            state, settled_in = settle(ids, args.settle)
            result["load_end"] = loadavg()
            result["scheduled"] = state
            result["settled_s_after_burst"] = _r(settled_in)
            result["statuses_at_settle"] = statuses(ids)
            result["settle_wait_s"] = round(time.monotonic() - t_settle, 1)
            if args.profile:
                result["profile"] = {
                    name: summarize_folded(tmp / f"{name}.folded")
                    for name in ("web", "worker", "web-after")
                }

    answers = rec["answers"]
    first = [a for a in answers if a[2] == 0]
    codes = collections.Counter(a[3] for a in first)
    accepted_first = sum(1 for _, attempt, _ in rec["accepted"] if attempt == 0)
    burst_s = rec["burst_end"] - rec["burst_start"]
    post_ms = [(a[1] - a[0]) * 1000 for a in answers]
    thr = rec["throttled"]
    per_user = rec["schedule_per_user"]
    result.update(
        {
            "submissions": len(first),
            "first_try": {str(k): v for k, v in codes.items()},
            "accepted_first_try": accepted_first,
            "accepted_final": len(rec["accepted"]),
            "throttled_answers": len(thr),
            "throttled_well_formed": sum(1 for _, ok in thr if ok),
            "retry_after_values": dict(collections.Counter(a for a, _ in thr)),
            "unavailable_answers": len(rec["unavailable"]),
            "unavailable_bodies": dict(
                collections.Counter(b for _, b in rec["unavailable"]).most_common(3)
            ),
            "unavailable_retry_after": dict(
                collections.Counter(a for a, _ in rec["unavailable"])
            ),
            "other": rec["other"][:10],
            "other_count": len(rec["other"]),
            "sends_s": round(rec["sends_done"] - rec["burst_start"], 1),
            "burst_s": round(burst_s, 1),
            "accepted_per_s": round(len(rec["accepted"]) / burst_s, 1),
            # the load generator's own CPU (this process; the pages' browser runs
            # in another), as a share of one core over the burst
            "generator_cpu_share": round(rec["generator_cpu_s"] / burst_s, 2),
            "post": summary(post_ms),
            "submissions_per_user": {
                "max": max(per_user.values()),
                "min": min(per_user.values()),
            },
        }
    )
    pages = rec["pages"]
    start, end = rec["burst_start"], rec["burst_end"]
    result["pages"] = {}
    for url in PAGES:
        idle = [ms for t, u, ms, _ in pages if u == url and t < start]
        during = [ms for t, u, ms, _ in pages if u == url and start <= t <= end]
        after = [ms for t, u, ms, _ in pages if u == url and t > end]
        bad = [c for t, u, _, c in pages if u == url and c != 200]
        result["pages"][url] = {
            "idle": summary(idle),
            "burst": summary(during),
            "after": summary(after),
            "non_200": len(bad),
        }
    during_all = [ms for t, _, ms, _ in pages if start <= t <= end]
    # every page load, seconds from the burst's start: for plotting over time
    result["page_loads"] = [
        (round(t - start, 2), url, round(ms, 1), code) for t, url, ms, code in pages
    ]
    result["pages_burst_all"] = summary(during_all)

    print(
        f"{result['submissions']} submissions by {args.users} users (skew "
        f"{args.skew}: {result['submissions_per_user']['min']}-"
        f"{result['submissions_per_user']['max']} each) sent over "
        f"{result['sends_s']} s; last answer after {result['burst_s']} s"
    )
    print(
        f"  first try: {result['first_try']}; accepted at first try "
        f"{accepted_first}; accepted in the end (retrying after Retry-After, "
        f"<= {args.retries} times) {result['accepted_final']}; "
        f"{result['accepted_per_s']} accepted/s"
    )
    print(
        f"  429 answers {len(thr)}, well formed (Retry-After + throttled body) "
        f"{result['throttled_well_formed']}; Retry-After values "
        f"{result['retry_after_values']}; other answers {result['other_count']} "
        f"{result['other'][:3]}"
    )
    print(
        f"  503 answers {result['unavailable_answers']} (Retry-After "
        f"{result['unavailable_retry_after']}): {result['unavailable_bodies']}"
    )
    p = result["post"]
    print(
        f"  POST answer time p50 {p['p50_ms']} ms  p95 {p['p95_ms']} ms  p99 "
        f"{p['p99_ms']} ms  max {p['max_ms']} ms"
    )
    print(
        f"  scheduled: {result['scheduled']} (settled "
        f"{result['settled_s_after_burst']} s after the burst); statuses "
        f"{result['statuses_at_settle']}"
    )
    for url, f in result["pages"].items():
        print(
            f"  page {url:8} idle p50 {f['idle']['p50_ms']} p95 {f['idle']['p95_ms']}"
            f" ms | burst p50 {f['burst']['p50_ms']} p95 {f['burst']['p95_ms']} max "
            f"{f['burst']['max_ms']} ms (n={f['burst']['n']}, non-200 {f['non_200']})"
            f" | after p50 {f['after']['p50_ms']} p95 {f['after']['p95_ms']} ms"
        )
    a = result["pages_burst_all"]
    print(f"  all pages during the burst: p95 {a['p95_ms']} ms (goal < 500 ms)")
    for name, prof in result.get("profile", {}).items():
        if not prof:
            continue
        print(f"  profile {name} ({prof['samples']} samples), own time:")
        for f, _, share in prof["own"][:10]:
            print(f"    {share:5}%  {f}")
        print(f"  profile {name}, total time (project frames):")
        for f, _, share in prof["total_project"][:10]:
            print(f"    {share:5}%  {f}")
    print(
        f"load generator's CPU: {result['generator_cpu_share']:.0%} of a core over "
        f"the burst (the pages' browser is a process of its own)"
    )
    print(
        f"load average: start {result['load_start']}  after burst "
        f"{result['load_after_burst']}  end {result['load_end']}"
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "submit_burst.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
