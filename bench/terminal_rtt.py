"""Terminal keystroke round trip through the portal, and a terminal load.

    python bench/terminal_rtt.py [--keys 1000] [--with-load 50]
    python bench/terminal_rtt.py --load 50 --seconds 60 --url U --token T --job J

The first form starts the real stack (``bench/real_stack.py``: web, worker,
beat, one simulated agent) on a fresh database, submits an interactive terminal
job and opens a terminal running ``cat`` over the job's websocket, as the
browser does (``Authorization: Bearer``, the CLI's way in). Each keystroke goes
viewer -> web process -> channel layer -> agent -> PTY, whose line discipline
echoes it, and back the same way; the time from the send to the echo is one
round trip. Prints p50/p90/p99/max over ``--keys`` keystrokes, one at a time,
and the machine's load. ``--with-load N`` runs N loaded terminals in the same
job meanwhile.

The load: N terminals, each running a shell loop that prints a line for every
line typed; each gets one keystroke line a second. ``LoadProcess`` runs it
(``TerminalLoad``) in a process of its own, the second form, so that another
benchmark can start it beside its own work without sharing its GIL; it prints
what its own lines saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_stack import fresh_database, loadavg, machine, pct, real_stack

if TYPE_CHECKING:
    from collections.abc import Iterator

ECHO_PROGRAM = "exec cat"
LOAD_PROGRAM = 'while read -r l; do echo "line $l done"; done'


def ws_url(base_url: str, job_id: int) -> str:
    return (
        base_url.replace("http://", "ws://").replace("https://", "wss://")
        + f"/ws/interactive/{job_id}/terminal/"
    )


async def open_terminal(
    url: str, token: str, command: str
) -> tuple[ClientConnection, str]:
    ws = await connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=2**20
    )
    await ws.send(
        json.dumps({"type": "open", "cols": 120, "rows": 40, "command": command})
    )
    while True:
        message = json.loads(await ws.recv())
        if message["type"] == "opened":
            return ws, message["terminal"]
        if message["type"] == "exit":
            raise RuntimeError(f"terminal refused: {message}")


async def _until_output(ws: ClientConnection, wanted: str, timeout: float) -> None:
    seen = ""
    async with asyncio.timeout(timeout):
        while wanted not in seen:
            message = json.loads(await ws.recv())
            if message["type"] == "exit":
                raise RuntimeError(f"terminal ended: {message}")
            if message["type"] == "output":
                seen = (seen + message["data"])[-4096:]


async def round_trips(url: str, token: str, keys: int) -> list[float]:
    """``keys`` keystrokes, one at a time; each one's round trip in ms."""
    ws, _ = await open_terminal(url, token, ECHO_PROGRAM)
    try:
        # cat is running once a line typed comes back twice (echo, then cat's).
        await ws.send(json.dumps({"type": "input", "data": "ready\r"}))
        await _until_output(ws, "ready\r\nready", 30)
        times: list[float] = []
        alphabet = "abcdefghijklmnopqrstuvwxyz"
        for i in range(keys):
            key = alphabet[i % len(alphabet)]
            if i % 60 == 59:
                key = "\r"  # keep cat's line short
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "input", "data": key}))
            await _until_output(ws, key if key != "\r" else "\n", 10)
            times.append((time.perf_counter() - t0) * 1000)
        return times
    finally:
        await ws.close()


class LoadProcess:
    """``TerminalLoad`` in a process of its own (this file's ``--load`` mode), so
    that its clients do not share the GIL with the benchmark that starts it."""

    def __init__(self, base_url: str, token: str, job_id: int, count: int) -> None:
        self.argv = [
            sys.executable, __file__, "--load", str(count), "--seconds", "86400",
            "--url", base_url, "--token", token, "--job", str(job_id),
        ]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 180) -> LoadProcess:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            if line.startswith("ready"):
                return self
            if time.monotonic() > deadline:
                break
        raise RuntimeError("terminal load did not start")

    def stop(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        self.proc.send_signal(signal.SIGINT)
        out = self.proc.stdout.read()
        self.proc.wait(30)
        for line in out.splitlines():
            if line.startswith("load: "):
                result: dict[str, Any] = json.loads(line[len("load: ") :])
                return result
        return {"error": out[-2000:]}


class TerminalLoad:
    """``count`` terminals in job ``job_id``, each sent one line a second and
    printing one line for it, in a thread of its own until ``stop``
    (``LoadProcess`` runs it in a process of its own)."""

    def __init__(self, base_url: str, token: str, job_id: int, count: int) -> None:
        self.url = ws_url(base_url, job_id)
        self.token = token
        self.count = count
        self.lines_back = 0
        self.line_ms: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terminal-load")

    def start(self, timeout: float = 120) -> TerminalLoad:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"terminal load not ready: {self.errors}")
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(30)
        return {
            "terminals": self.count,
            "lines_back": self.lines_back,
            "line_p50_ms": pct(self.line_ms, 50),
            "line_p99_ms": pct(self.line_ms, 99),
            "errors": self.errors[:5],
        }

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        sockets = []
        try:
            for _ in range(self.count):
                ws, _ = await open_terminal(self.url, self.token, LOAD_PROGRAM)
                sockets.append(ws)
            self._ready.set()
            await asyncio.gather(*(self._drive(ws, i) for i, ws in enumerate(sockets)))
        except Exception as exc:
            self.errors.append(repr(exc))
            self._ready.set()
        finally:
            for ws in sockets:
                # End the loop (EOF), so the terminal does not linger after.
                with contextlib.suppress(Exception):
                    await ws.send(json.dumps({"type": "input", "data": "\x04"}))
                await ws.close()

    async def _drive(self, ws: ClientConnection, index: int) -> None:
        # Spread the terminals over the second.
        await asyncio.sleep(index / max(self.count, 1))
        n = 0
        while not self._stop.is_set():
            n += 1
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "input", "data": f"t{index}-{n}\r"}))
            try:
                await _until_output(ws, f"line t{index}-{n} ", 10)
                self.line_ms.append((time.perf_counter() - t0) * 1000)
                self.lines_back += 1
            except (TimeoutError, RuntimeError) as exc:
                self.errors.append(f"terminal {index}: {exc!r}")
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))


def summary(label: str, times: list[float]) -> str:
    def f(q: float) -> str:
        v = pct(times, q)
        return "-" if v is None else f"{v:.1f}"

    return (
        f"{label}: n={len(times)} p50={f(50)} ms p90={f(90)} ms p99={f(99)} ms"
        f" max={max(times):.1f} ms"
    )


def start_job(user: Any) -> int:
    """Submit the bench user's interactive terminal job; its id once it runs."""
    from scheduler.models import Job
    from scheduler.services.jobs import interactive_request, submit_job

    job = submit_job(user, interactive_request("shell", gpus=1, workdir="/tmp"))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status = Job.objects.values_list("status", flat=True).get(pk=job.pk)
        if status == "running":
            return job.pk
        if status in Job.TERMINAL:
            raise RuntimeError(f"job {job.pk} ended: {status}")
        time.sleep(0.2)
    raise RuntimeError(f"job {job.pk} not running after 90 s")


@contextlib.contextmanager
def run_as() -> Iterator[str]:
    """As root, an ordinary Unix account for the terminal job (an agent refuses
    to run a job as root); else none: the job runs as this user."""
    if os.geteuid() != 0:
        yield ""
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.interactive.accounts import jupyter_account

    with jupyter_account() as account:
        yield account.pw_name


def stack_run(args: argparse.Namespace) -> int:
    with (
        run_as() as account,
        tempfile.TemporaryDirectory(prefix="bench-terminal-") as tmp,
        fresh_database("terminal") as db_url,
    ):
        from django.contrib.auth import get_user_model

        from portal.api.tokens import create_token
        from scheduler.models import Profile

        user = get_user_model().objects.create_user("bench-terminal", password="x")
        if account:
            Profile.objects.update_or_create(
                user=user, defaults={"unix_account": account}
            )
        token = create_token(user, "bench", None)[1]
        with real_stack(db_url, Path(tmp), args.cluster) as stack:
            job_id = start_job(user)
            from django.db import connections

            connections.close_all()
            print(f"machine: {machine()}; load before: {loadavg()}")
            load = None
            if args.with_load:
                load = LoadProcess(stack.base_url, token, job_id, args.with_load)
                load.start()
                print(f"{args.with_load} loaded terminals running")
            times = asyncio.run(
                round_trips(ws_url(stack.base_url, job_id), token, args.keys)
            )
            print(summary("keystroke round trip", times))
            if load is not None:
                print(f"load: {load.stop()}")
            print(f"load after: {loadavg()}")
    return 0


def load_run(args: argparse.Namespace) -> int:
    """Until ``--seconds`` pass or SIGINT: ``ready`` once every terminal is
    open, then ``load: {json}`` at the end."""
    print(f"machine: {machine()}; load before: {loadavg()}", flush=True)
    load = TerminalLoad(args.url, args.token, args.job, args.load).start()
    print("ready", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        time.sleep(args.seconds)
    print(f"load: {json.dumps(load.stop())}", flush=True)
    print(f"load after: {loadavg()}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--with-load", type=int, default=0, metavar="N")
    parser.add_argument("--cluster", default="1x2:A100-80GB")
    parser.add_argument("--load", type=int, default=0, metavar="N")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--url", help="a running portal (with --load)")
    parser.add_argument("--token", help="an API token of the job's owner")
    parser.add_argument("--job", type=int, help="a running interactive job")
    args = parser.parse_args()
    if args.load:
        if not (args.url and args.token and args.job):
            parser.error("--load needs --url, --token and --job")
        return load_run(args)
    return stack_run(args)


if __name__ == "__main__":
    sys.exit(main())
