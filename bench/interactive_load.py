"""Other users' pages while one web process carries 50 terminals and 20 notebooks.

    python -m portal.stack.run -- python bench/interactive_load.py [--rounds 3]

A fresh database and ``make up``'s processes on it (``bench/real_stack.py``: one
web process, worker, notifier, beat and ``--cluster`` simulated agents, default
``3x8:A100-80GB``), the agents finding this venv's ``jupyter`` on their PATH and
binding it to loopback. Run as root: JupyterLab runs as a Unix account of its
own (``tests.interactive.accounts``), never as root.

- **Interactive jobs**: one user (``GPULAB_INTERACTIVE_MAX_PER_USER`` raised for
  it) starts ``--notebooks`` (20) JupyterLab jobs and one terminal job; the
  bench waits until every JupyterLab answers ``api/status`` through the proxy.
- **The load**, in processes of their own (their clients must not share a GIL
  with the pages' browser or with each other):
  ``--terminals`` (50) terminals in the terminal job, each sent one line a second
  and printing a line for it (``terminal_rtt.LoadProcess``); and one kernel per
  JupyterLab, created through the proxy with the owner's session cookie
  (``POST /interactive/<id>/api/kernels``) and driven over the kernel
  websocket (``api/kernels/<kid>/channels``, Jupyter's JSON message frames):
  an ``execute_request`` every 10 s per kernel, spread over the 10 s, whose cell
  prints a line; its time is the request sent -> the printed line and the
  ``execute_reply`` back (``NotebookLoad``, this file's ``--notebook-load`` mode).
- **The pages**: another user, signed in through the login form, loads ``/``,
  ``/queue/`` and ``/jobs/`` in turn, one at a time, from a process of its own,
  for the whole run: ``submit_burst.py``'s page benchmark (``browse``).
- **Interleaved**: ``--rounds`` times, ``--seconds`` (60) without the load, then
  the load started (every terminal open and every kernel answering), 3 s to
  settle, ``--seconds`` with it, the load stopped (kernels shut down). Page
  loads are counted in the phase they started in; loads while the load starts
  or stops are not counted.

Prints per page and phase p50 / p95 / max and errors (goal: p95 < 200 ms with
the load), the load's own figures (terminal line p50/p99, cell p50/p99, cells
run, errors), the web process's CPU (% of one core) per phase and the load
average; writes ``<out-dir>/interactive_load.json``. ``--profile`` runs the web
process under cProfile (``--profile-out``) and prints its top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

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
from submit_burst import PAGES, browser_process
from terminal_rtt import LoadProcess

sys.path.insert(0, str(ROOT))

PASSWORD = "bench-pw-1"
CELL_EVERY_S = 10.0


# ------------------------------------------------------------ kernel client


def message(session: str, msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
    """One Jupyter message (messaging protocol 5.3) for the kernel websocket's
    JSON frames: the channel rides beside the message."""
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "username": "bench",
            "session": session,
            "msg_type": msg_type,
            "version": "5.3",
            "date": dt.datetime.now(dt.UTC).isoformat(),
        },
        "parent_header": {},
        "metadata": {},
        "content": content,
        "channel": "shell",
        "buffers": [],
    }


def execute(session: str, code: str) -> dict[str, Any]:
    return message(
        session,
        "execute_request",
        {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
    )


async def until_done(ws: ClientConnection, msg: dict[str, Any], timeout: float) -> str:
    """Send ``msg``; the text its cell printed, once its ``execute_reply`` (or
    ``kernel_info_reply``) is back. A failed cell raises with its error."""
    msg_id = msg["header"]["msg_id"]
    await ws.send(json.dumps(msg))
    printed = ""
    replied = idle = False
    wants_idle = msg["header"]["msg_type"] == "execute_request"
    async with asyncio.timeout(timeout):
        while not (replied and (idle or not wants_idle)):
            frame = json.loads(await ws.recv())
            if frame.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = frame["header"]["msg_type"]
            if kind == "stream":
                printed += frame["content"]["text"]
            elif kind == "error":
                raise RuntimeError(f"cell failed: {frame['content'].get('ename')}")
            elif kind.endswith("_reply"):
                if frame["content"].get("status", "ok") != "ok":
                    raise RuntimeError(f"{kind}: {frame['content']}")
                replied = True
            elif kind == "status" and frame["content"]["execution_state"] == "idle":
                # iopub's idle follows every output of the request (the
                # reply comes on shell, in either order).
                idle = True
    return printed


class Kernel:
    """A kernel in one interactive job's JupyterLab, through the portal's proxy."""

    def __init__(self, base_url: str, cookie: str, job_id: int) -> None:
        self.base = f"{base_url}/interactive/{job_id}/"
        self.ws_base = self.base.replace("http://", "ws://")
        self.cookie = cookie
        self.job_id = job_id
        self.session = uuid.uuid4().hex
        self.kernel_id = ""
        self.ws: ClientConnection | None = None
        self.refused = 0  # handshakes refused before one was accepted

    async def open(self, http: httpx.AsyncClient) -> Kernel:
        resp = await http.post(
            self.base + "api/kernels",
            json={"name": "python3"},
            headers={"Cookie": self.cookie},
        )
        if resp.status_code != 201:
            raise RuntimeError(
                f"job {self.job_id}: POST api/kernels {resp.status_code}:"
                f" {resp.text[:500]}"
            )
        self.kernel_id = resp.json()["id"]
        url = (
            f"{self.ws_base}api/kernels/{self.kernel_id}/channels"
            f"?session_id={self.session}"
        )
        # As JupyterLab's own client does, a refused handshake is tried again:
        # the proxy gives up on a kernel's socket that JupyterLab does not
        # accept within GPULAB_INTERACTIVE_CONNECT_TIMEOUT (a kernel still
        # starting on a busy node), closing it before accepting it (HTTP 403).
        for attempt in range(10):
            try:
                self.ws = await connect(
                    url,
                    additional_headers={"Cookie": self.cookie},
                    max_size=2**24,
                    open_timeout=120,
                )
                break
            except (InvalidStatus, TimeoutError):
                self.refused += 1
                if attempt == 9:
                    raise
                await asyncio.sleep(1)
        info = message(self.session, "kernel_info_request", {})
        await until_done(self.ws, info, 120)
        await until_done(self.ws, execute(self.session, "n = 0"), 60)
        return self

    async def run(self, code: str, timeout: float = 30) -> str:
        """Run ``code`` in the kernel; what it printed."""
        assert self.ws is not None
        return await until_done(self.ws, execute(self.session, code), timeout)

    async def run_cell(self) -> str:
        return await self.run("n += 1\nprint(f'cell {n} done')")

    async def close(self, http: httpx.AsyncClient) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.kernel_id:
            with contextlib.suppress(httpx.HTTPError):
                await http.delete(
                    self.base + f"api/kernels/{self.kernel_id}",
                    headers={"Cookie": self.cookie},
                )


class NotebookLoad:
    """One kernel per job, each running a cell every ``CELL_EVERY_S``, spread
    over that time, until SIGINT."""

    def __init__(self, base_url: str, cookie: str, jobs: list[int]) -> None:
        self.base_url = base_url
        self.cookie = cookie
        self.jobs = jobs
        self.cell_ms: list[float] = []
        self.cells = 0
        self.errors: list[str] = []
        self.refused = 0
        self.stop = asyncio.Event()

    async def main(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=120) as http:
            starting = asyncio.Semaphore(4)

            async def opened(job_id: int) -> Kernel:
                # A few at a time, as people open notebooks: 20 kernels starting
                # at once on a busy node can take minutes.
                async with starting:
                    for attempt in range(3):
                        kernel = Kernel(self.base_url, self.cookie, job_id)
                        try:
                            return await kernel.open(http)
                        except (
                            OSError,
                            RuntimeError,
                            TimeoutError,
                            ConnectionClosed,
                        ) as exc:
                            self.errors.append(f"opening job {job_id}: {exc!r}")
                            await kernel.close(http)
                            if attempt == 2:
                                raise
                raise AssertionError("unreachable")

            kernels = await asyncio.gather(*(opened(j) for j in self.jobs))
            self.refused = sum(k.refused for k in kernels)
            print("ready", flush=True)
            try:
                await asyncio.gather(*(self.drive(k, i) for i, k in enumerate(kernels)))
            finally:
                await asyncio.gather(*(k.close(http) for k in kernels))
        return {
            "notebooks": len(self.jobs),
            "cells": self.cells,
            "cell_p50_ms": pct(self.cell_ms, 50),
            "cell_p99_ms": pct(self.cell_ms, 99),
            "handshakes_refused": self.refused,
            "errors": self.errors[:5],
        }

    async def drive(self, kernel: Kernel, index: int) -> None:
        # Spread the kernels over the period.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(index * CELL_EVERY_S / len(self.jobs)):
                await self.stop.wait()
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                printed = await kernel.run_cell()
                if "done" not in printed:
                    raise RuntimeError(f"cell printed {printed!r}")
                self.cell_ms.append((time.perf_counter() - t0) * 1000)
                self.cells += 1
            except (TimeoutError, RuntimeError, OSError) as exc:
                self.errors.append(f"job {kernel.job_id}: {exc!r}")
            wait = max(0.0, CELL_EVERY_S - (time.perf_counter() - t0))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self.stop.wait()


def notebook_load_run(args: argparse.Namespace) -> int:
    """This file's ``--notebook-load`` mode: ``ready`` once every kernel
    answers, then ``load: {json}`` after SIGINT."""
    jobs = [int(j) for j in args.jobs.split(",")]
    cookie = os.environ["BENCH_COOKIE"]  # not on the command line
    load = NotebookLoad(args.url, cookie, jobs)

    async def run() -> dict[str, Any]:
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, load.stop.set)
        return await load.main()

    result = asyncio.run(run())
    print(f"load: {json.dumps(result)}", flush=True)
    return 0


class NotebookProcess:
    """``NotebookLoad`` in a process of its own."""

    def __init__(self, base_url: str, cookie: str, jobs: list[int]) -> None:
        self.argv = [
            sys.executable, __file__, "--notebook-load", "--url", base_url,
            "--jobs", ",".join(map(str, jobs)),
        ]  # fmt: skip
        self.env = {**os.environ, "BENCH_COOKIE": cookie}
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 300) -> NotebookProcess:
        self.proc = subprocess.Popen(
            self.argv, env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert self.proc.stdout is not None
        seen = []
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            if line.startswith("ready"):
                return self
            seen.append(line)
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"notebook load did not start: {''.join(seen)[-3000:]}")

    def stop(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        self.proc.send_signal(signal.SIGINT)
        out = self.proc.stdout.read()
        self.proc.wait(60)
        for line in out.splitlines():
            if line.startswith("load: "):
                result: dict[str, Any] = json.loads(line[len("load: ") :])
                return result
        return {"error": out[-2000:]}


# ------------------------------------------------------------ setup


def make_users(account: str) -> str:
    """The load's owner (the Unix account's, an API token) and the pages' user;
    the owner's token."""
    from django.contrib.auth.models import User

    from portal.api import tokens
    from scheduler.models import Profile

    owner = User.objects.create_user("bench-owner", password=PASSWORD)
    Profile.objects.update_or_create(user=owner, defaults={"unix_account": account})
    User.objects.create_user("bench-pages", password=PASSWORD)
    return tokens.create_token(owner, "bench", None)[1]


def session_cookie(base_url: str, user: str) -> str:
    """A ``Cookie`` header of ``user`` signed in through the login form."""
    with signed_in(base_url, user, PASSWORD) as client:
        return "; ".join(f"{k}={v}" for k, v in client.cookies.items())


def start_jobs(
    api: httpx.Client, cookie: str, notebooks: int, workdir: str
) -> tuple[list[int], int]:
    """``notebooks`` JupyterLab jobs answering through the proxy, and a
    running terminal job."""
    labs = []
    for _ in range(notebooks):
        resp = api.post(
            "/api/v1/jobs/", json={"interactive": "jupyter", "workdir": workdir}
        )
        if resp.status_code != 201:
            raise RuntimeError(f"POST jupyter: {resp.status_code} {resp.text[:300]}")
        labs.append(resp.json()["id"])
    resp = api.post("/api/v1/jobs/", json={"interactive": "shell", "workdir": "/tmp"})
    if resp.status_code != 201:
        raise RuntimeError(f"POST shell: {resp.status_code} {resp.text[:300]}")
    shell = resp.json()["id"]
    waiting = set(labs)
    deadline = time.monotonic() + 600
    with httpx.Client(timeout=30, headers={"Cookie": cookie}) as browser:
        while waiting:
            for job_id in sorted(waiting):
                url = f"{str(api.base_url).rstrip('/')}/interactive/{job_id}/api/status"
                if browser.get(url).status_code == 200:
                    waiting.discard(job_id)
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab not answering: jobs {sorted(waiting)}")
            time.sleep(0.5)
    while api.get(f"/api/v1/jobs/{shell}/").json()["state"] != "running":
        if time.monotonic() > deadline:
            raise RuntimeError(f"terminal job {shell} not running")
        time.sleep(0.2)
    return labs, shell


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------ the run


def phases(
    args: argparse.Namespace, stack: Any, token: str, cookie: str,
    labs: list[int], shell: int,
) -> dict[str, Any]:  # fmt: skip
    """The interleaved phases; each one's window, web CPU and load figures."""
    web_pid = stack.procs["web"].popen.pid
    windows: list[dict[str, Any]] = []
    loads: dict[str, int] = {}

    def cpus() -> dict[str, float]:
        pids = {name: proc.popen.pid for name, proc in stack.procs.items()}
        out = {}
        for name, pid in {**pids, **loads}.items():
            with contextlib.suppress(OSError):
                out[name] = cpu_seconds(pid)
        return out

    def measure(kind: str) -> dict[str, Any]:
        time.sleep(3)  # settle
        c0, t0, load0 = cpu_seconds(web_pid), time.time(), loadavg()
        each0 = cpus()
        time.sleep(args.seconds)
        c1, t1 = cpu_seconds(web_pid), time.time()
        each1 = cpus()
        window = {
            "phase": kind,
            "start": t0,
            "end": t1,
            "web_cpu_pct": round(100 * (c1 - c0) / (t1 - t0), 1),
            # Each process's CPU over the phase, % of one core (the stack's,
            # and the load generators').
            "cpu_pct": {
                name: round(100 * (each1[name] - each0[name]) / (t1 - t0), 1)
                for name in each0
                if name in each1
            },
            "load_start": load0,
            "load_end": loadavg(),
        }
        windows.append(window)
        print(
            f"  {kind:>7}: web CPU {window['web_cpu_pct']} % of a core,"
            f" load {load0.split()[0]} -> {window['load_end'].split()[0]};"
            f" CPU % by process {window['cpu_pct']}",
            flush=True,
        )
        return window

    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        measure("without")
        terminals = LoadProcess(stack.base_url, token, shell, args.terminals).start()
        notebooks = NotebookProcess(stack.base_url, cookie, labs).start()
        assert terminals.proc is not None and notebooks.proc is not None
        loads.update(terminal_load=terminals.proc.pid, notebook_load=notebooks.proc.pid)
        window = measure("with")
        loads.clear()
        window["terminal_load"] = terminals.stop()
        window["notebook_load"] = notebooks.stop()
        print(f"    terminals: {window['terminal_load']}", flush=True)
        print(f"    notebooks: {window['notebook_load']}", flush=True)
    return {"windows": windows}


def page_summary(
    pages: list[tuple[float, str, float, int]], windows: list[dict[str, Any]]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("without", "with"):
        spans = [(w["start"], w["end"]) for w in windows if w["phase"] == kind]
        inside = [p for p in pages if any(a <= p[0] <= b for a, b in spans)]
        per: dict[str, Any] = {}
        for url in (*PAGES, "all"):
            rows = [p for p in inside if url in ("all", p[1])]
            ms = [p[2] for p in rows if p[3] == 200]
            per[url] = {
                "n": len(rows),
                "errors": sum(1 for p in rows if p[3] != 200),
                "p50_ms": _r(pct(ms, 50)),
                "p95_ms": _r(pct(ms, 95)),
                "max_ms": _r(max(ms, default=None)),
            }
        out[kind] = per
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=int, default=20)
    parser.add_argument("--terminals", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--cluster", default="3x8:A100-80GB")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument(
        "--profile", action="store_true", help="the web process under cProfile"
    )
    parser.add_argument("--profile-out", default="/tmp/interactive_load.prof")
    parser.add_argument("--notebook-load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.notebook_load:
        return notebook_load_run(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not is_root():
        return 1
    result = bench_record(
        notebooks=args.notebooks,
        terminals=args.terminals,
        rounds=args.rounds,
        seconds=args.seconds,
        cluster=args.cluster,
    )
    extra_env = {"GPULAB_INTERACTIVE_MAX_PER_USER": str(args.notebooks + 1)}
    with interactive_stack(
        "interactive_load", args.cluster, make_users, extra_env
    ) as lab:
        stack, api, workdir, token = lab.stack, lab.api, lab.workdir, lab.token
        if args.profile:
            stack = profiled_web(stack, args.profile_out)
        owner_cookie = session_cookie(stack.base_url, "bench-owner")
        t0 = time.monotonic()
        labs, shell = start_jobs(api, owner_cookie, args.notebooks, str(workdir))
        print(
            f"{len(labs)} JupyterLab jobs answering and terminal job {shell}"
            f" running after {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        ctx = multiprocessing.get_context("spawn")
        stop, pages_out = ctx.Event(), ctx.Queue()
        browser = ctx.Process(
            target=browser_process,
            args=(stack.base_url, "bench-pages", stop, pages_out),
        )
        browser.start()
        time.sleep(5)  # signed in and warm
        result.update(phases(args, stack, token, owner_cookie, labs, shell))
        stop.set()
        pages = pages_out.get(timeout=300)
        browser.join(30)
        for job_id in (*labs, shell):
            api.post(f"/api/v1/jobs/{job_id}/cancel/")
        if args.profile:
            stop_profile(stack)
    result["load_end"] = loadavg()
    result["pages"] = page_summary(pages, result["windows"])
    print("\npages of another user (p50 / p95 / max ms, n, errors); goal p95 < 200 ms")
    for url in (*PAGES, "all"):
        cells = []
        for kind in ("without", "with"):
            s = result["pages"][kind][url]
            cells.append(
                f"{kind}: {s['p50_ms']} / {s['p95_ms']} / {s['max_ms']}"
                f" (n={s['n']}, err={s['errors']})"
            )
        print(f"  {url:>8}  " + "   ".join(cells))
    cpu = {
        k: [w["web_cpu_pct"] for w in result["windows"] if w["phase"] == k]
        for k in ("without", "with")
    }
    print(f"web process CPU % of a core per phase: {cpu}")
    print(f"load average at end: {result['load_end']}")
    if args.profile:
        print_profile(args.profile_out)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interactive_load.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


# ------------------------------------------------------------ profiling


def profiled_web(stack: Any, path: str) -> Any:
    """Restart the web process under cProfile on the same port (written to
    ``path`` when it is stopped with SIGINT)."""
    web = stack.procs["web"]
    argv = list(web.popen.args)
    web.popen.send_signal(signal.SIGTERM)
    web.popen.wait(30)
    i = argv.index("-m")
    argv[i : i + 1] = ["-m", "cProfile", "-o", path, "-m"]
    stack.start("web", argv).wait_for(r"Uvicorn running on")
    return stack


def stop_profile(stack: Any) -> None:
    web = stack.procs["web"].popen
    web.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        web.wait(60)


def print_profile(path: str) -> None:
    import pstats

    if not Path(path).exists():
        print(f"no profile at {path}")
        return
    stats = pstats.Stats(path)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
