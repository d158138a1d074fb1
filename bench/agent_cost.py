"""Agent cost: CPU time and memory of the real node agent on a simulated 8-GPU node.

Starts ``python -m agents --simulate 8xA100-80GB --sample-interval 1`` (its own state
directory in a temporary directory) against a minimal loopback websocket server that
plays the portal: it acks every durable frame and every metrics frame with its seq,
as the real server does. After ``--warmup`` seconds it measures for ``--seconds``
(default 60):

- agent CPU: utime + stime from ``/proc/<pid>/stat`` over the wall time, as % of one
  core (goal: under 1 %);
- agent memory: VmRSS (and the peak, VmHWM) from ``/proc/<pid>/status`` at the end;
- with ``--jobs N``: N jobs (``sleep``, one per GPU) run through the agent, and the
  CPU of their shims is measured too (per shim, same way).

Prints a table and writes ``<out-dir>/agent_cost.json``. Needs no database.
``--profile FILE`` runs the agent under cProfile (slower; for finding hot spots).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

ROOT = Path(__file__).resolve().parent.parent
ACKED = {"job.started", "job.exited", "job.log", "metrics"}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def tree_cpu_seconds(pid: int) -> float | None:
    """``cpu_seconds`` of ``pid`` and every live descendant (uvicorn's workers
    under ``WEB_CONCURRENCY``), None if ``pid`` is gone."""
    own = cpu_seconds(pid)
    if own is None:
        return None
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text[text.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total, todo = own, list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        total += cpu_seconds(child) or 0.0
        todo.extend(children.get(child, ()))
    return total


def status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Portal:
    def __init__(self) -> None:
        self.frames: Counter[str] = Counter()
        self.bytes = 0
        self.hello: dict[str, Any] | None = None
        self.hello_seen = asyncio.Event()
        self.exited: set[int] = set()
        self.conn: ServerConnection | None = None
        self._seq = itertools.count(1)

    async def send(self, type_: str, data: dict[str, Any]) -> None:
        assert self.conn is not None
        frame = {"type": type_, "v": 2, "seq": next(self._seq), "ts": time.time()}
        await self.conn.send(json.dumps({**frame, "data": data}))

    async def handler(self, ws: ServerConnection) -> None:
        self.conn = ws
        async for raw in ws:
            self.bytes += len(raw)
            msg = json.loads(raw)
            self.frames[msg["type"]] += 1
            if msg["type"] in ACKED:
                await self.send("ack", {"seq": msg["seq"]})
            if msg["type"] == "hello":
                self.hello = msg["data"]
                self.hello_seen.set()
            elif msg["type"] == "job.exited":
                self.exited.add(msg["data"]["attempt_id"])


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    portal = Portal()
    async with serve(portal.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        with tempfile.TemporaryDirectory(prefix="agent-cost-") as tmp:
            state = Path(tmp) / "state"
            profile = (
                ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
            )
            cmd = [
                sys.executable,
                *profile,
                "-m",
                "agents",
                "--server",
                f"ws://127.0.0.1:{port}",
                "--simulate",
                args.simulate,
                "--sample-interval",
                str(args.sample_interval),
                "--state-dir",
                str(state),
            ]
            if os.geteuid() == 0:
                cmd.append("--allow-root-jobs")
            env = {**os.environ, "GPULAB_AGENT_TOKEN": "bench-token"}
            with (Path(tmp) / "agent.log").open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, cwd=ROOT, env=env, stdout=log, stderr=log
                )
            try:
                await asyncio.wait_for(portal.hello_seen.wait(), 30)
                assert portal.hello is not None
                gpus = portal.hello["gpus"]
                for n in range(args.jobs):
                    await portal.send(
                        "job.launch",
                        {
                            "attempt_id": n + 1,
                            "attempt": 1,
                            "job_id": n + 1,
                            "name": f"bench {n}",
                            "command": f"sleep {int(args.warmup + args.seconds) + 60}",
                            "workdir": tmp,
                            "env": {"GPULAB_SIM_UTIL": "80"},
                            "gpu_uuids": [gpus[n % len(gpus)]["uuid"]],
                            "grace_s": 1,
                        },
                    )
                await asyncio.sleep(args.warmup)
                shims = []
                for n in range(args.jobs):
                    text = (state / "jobs" / str(n + 1) / "shim.pid").read_text()
                    shims.append(int(text.split()[0]))
                frames0 = sum(portal.frames.values())
                t0 = time.monotonic()
                cpu0 = cpu_seconds(proc.pid)
                shim0 = [cpu_seconds(pid) or 0.0 for pid in shims]
                await asyncio.sleep(args.seconds)
                elapsed = time.monotonic() - t0
                cpu1 = cpu_seconds(proc.pid)
                shim1 = [cpu_seconds(pid) or 0.0 for pid in shims]
                rss = status_kib(proc.pid, "VmRSS")
                hwm = status_kib(proc.pid, "VmHWM")
                frames = sum(portal.frames.values()) - frames0
                for n in range(args.jobs):
                    await portal.send(
                        "job.kill",
                        {
                            "attempt_id": n + 1,
                            "job_id": n + 1,
                            "reason": "cancelled",
                            "grace_s": 0,
                        },
                    )
                deadline = time.monotonic() + 15
                while len(portal.exited) < args.jobs and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
    if cpu0 is None or cpu1 is None:
        raise RuntimeError("the agent exited during the measurement")
    shim_pct = [100 * (b - a) / elapsed for a, b in zip(shim0, shim1, strict=True)]
    return {
        "simulate": args.simulate,
        "sample_interval_s": args.sample_interval,
        "jobs": args.jobs,
        "seconds": round(elapsed, 2),
        "agent_cpu_s": round(cpu1 - cpu0, 3),
        "agent_cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / elapsed, 3),
        "agent_rss_mib": round((rss or 0) / 1024, 1),
        "agent_peak_rss_mib": round((hwm or 0) / 1024, 1),
        "shim_cpu_pct_each": [round(x, 3) for x in shim_pct],
        "frames_per_s": round(frames / elapsed, 2),
        "frames_by_type": dict(portal.frames),
        "bytes_received": portal.bytes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--simulate", default="8xA100-80GB")
    ap.add_argument("--sample-interval", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=0, help="jobs to run meanwhile (0)")
    ap.add_argument(
        "--profile", type=Path, help="run the agent under cProfile, stats to this file"
    )
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    try:
        result = asyncio.run(measure(args))
    except (OSError, RuntimeError, TimeoutError) as exc:
        sys.stderr.write(f"agent_cost: could not run: {exc!r}\n")
        return 1
    rows = [
        ("node", f"{result['simulate']}, sample every {result['sample_interval_s']} s"),
        ("jobs running", str(result["jobs"])),
        ("measured", f"{result['seconds']} s"),
        ("agent CPU", f"{result['agent_cpu_pct_of_one_core']:.3f} % of one core"),
        (
            "agent RSS",
            f"{result['agent_rss_mib']} MiB (peak {result['agent_peak_rss_mib']})",
        ),
        ("frames/s to portal", str(result["frames_per_s"])),
    ]
    if result["shim_cpu_pct_each"]:
        each = result["shim_cpu_pct_each"]
        rows.append(("shim CPU (max)", f"{max(each):.3f} % of one core per job"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        sys.stdout.write(f"{key:<{width}}  {value}\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "agent_cost.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(f"wrote {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
