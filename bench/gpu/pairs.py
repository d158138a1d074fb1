"""Measure each workload alone and in pairs on one GPU, in Gavel's table formats.

Every workload runs in its own long-lived ``bench.gpu.workloads serve`` process,
started once. Solo: each alone, 5 s warm-up then 10 s counted. Pairs: two servers
given the same start time share the GPU by time-slicing, 5 s warm-up then 15 s
counted; most informative first (different families, one order each, in an order
that brings every workload in early), then the reverse orders while time remains.

For a pair (A, B): norm_A = A's rate shared / A's rate alone, r_AB = 1 / norm_A
(A's slowdown, SEEDS.md), and sharing pays (P2) when r_AB * r_BA < r_AB + r_BA.

Written after every measurement, so a run stopped at its deadline keeps what it
measured (``write``): ``<gpu>_colocation_pairs.csv`` and
``<gpu>_isolated_throughputs.csv`` in the formats of Gavel's tables
(../shared/datasets/gavel_colocation_throughputs), ``<gpu>_solo_nvml.csv`` (each
workload's solo busy fraction, memory and power) and ``<gpu>_runs_nvml.csv`` (the
NVML view of every run: per process SM utilisation and memory, GPU utilisation and
power, means over the counted window).
"""

from __future__ import annotations

import csv
import itertools
import json
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from statistics import mean
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Sequence
    from pathlib import Path

    from agents.nvml import GpuReader

WARMUP_S = 5.0
SOLO_S = 10.0
PAIR_S = 15.0
# Time between telling the servers to run and the shared start: both have read
# their command by then.
LEAD_S = 0.5

PAIR_COLUMNS = [
    "worker_type",
    "gpu_type",
    "consolidated",
    "job_a",
    "scale_factor_a",
    "job_b",
    "scale_factor_b",
    "isolated_a",
    "isolated_b",
    "colocated_a",
    "colocated_b",
    "norm_a",
    "norm_b",
    "combined_norm",
    "feasible",
    "n_at_isolated",
]
ISOLATED_COLUMNS = [
    "worker_type",
    "gpu_type",
    "consolidated",
    "job_type",
    "scale_factor",
    "isolated_steps_per_sec_simulation_json",
    "isolated_steps_per_sec_physical_json",
]


class Server:
    """One ``workloads serve`` process; its stdout lines arrive on a queue."""

    def __init__(self, model: str, batch: int | None, extra: Sequence[str]) -> None:
        cmd = [sys.executable, "-m", "bench.gpu.workloads", "serve", "--model", model]
        if batch is not None:
            cmd += ["--batch", str(batch)]
        self.model = model
        self.name = model
        self.pid = 0
        self.memory_mib = 0.0
        self.error = ""
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                continue  # library chatter on stdout
        self.lines.put({"event": "exit", "code": self.proc.wait()})

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return {"event": "timeout"}

    def ready(self, timeout: float) -> bool:
        msg = self.next(timeout)
        if msg.get("event") == "ready":
            self.name, self.pid = msg["name"], msg["pid"]
            self.memory_mib = msg["memory_mib"]
            return True
        self.name = msg.get("name", self.name)
        self.error = msg.get("error") or f"no ready line ({msg})"
        return False

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


@dataclass
class Sampler:
    """NVML readings every ``every_s`` over a window, through the agent's reader."""

    reader: GpuReader
    every_s: float = 0.5

    def over(self, begin: float, end: float) -> dict[str, Any]:
        util: list[float] = []
        power: list[float] = []
        procs: dict[int, dict[str, list[float]]] = {}
        while time.time() < begin:
            time.sleep(min(0.05, begin - time.time()))
        while time.time() < end:
            for s in self.reader.sample(lambda _pid: None)[:1]:
                if s.util_gpu is not None:
                    util.append(s.util_gpu)
                if s.power_w is not None:
                    power.append(s.power_w)
                for p in s.processes:
                    entry = procs.setdefault(p.pid, {"sm": [], "mem": []})
                    if p.sm_util is not None:
                        entry["sm"].append(p.sm_util)
                    if p.used_memory_mib is not None:
                        entry["mem"].append(p.used_memory_mib)
            time.sleep(self.every_s)
        return {
            "util_gpu": mean(util) if util else None,
            "power_w": mean(power) if power else None,
            "processes": {
                pid: {
                    "sm_util": mean(v["sm"]) if v["sm"] else None,
                    "memory_mib": max(v["mem"]) if v["mem"] else None,
                }
                for pid, v in procs.items()
            },
        }


@dataclass
class Harness:
    gpu: str  # worker_type in the tables: "h100", "h200"
    out: Path
    sampler: Sampler | None
    log: Callable[[str], None] = print
    servers: list[Server] = field(default_factory=list)
    solo: dict[str, float] = field(default_factory=dict)
    solo_view: dict[str, dict[str, Any]] = field(default_factory=dict)
    pairs: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    warmup_s: float = WARMUP_S
    solo_s: float = SOLO_S
    pair_s: float = PAIR_S

    def start(
        self,
        models: Sequence[tuple[str, int | None]],
        extra: Sequence[str],
        wait: float,
    ) -> None:
        """Start every server at once; keep those ready within ``wait`` s."""
        started = [Server(m, b, extra) for m, b in models]
        deadline = time.monotonic() + wait
        for s in started:
            if s.ready(deadline - time.monotonic()):
                self.servers.append(s)
                self.log(f"ready: {s.name} (pid {s.pid}, {s.memory_mib:.0f} MiB)")
            else:
                self.failed[s.name] = s.error
                self.log(f"FAILED to start: {s.name}: {s.error}")
                s.proc.kill()

    def close(self) -> None:
        for s in self.servers:
            s.close()

    def _measure(self, group: Sequence[Server], window: float) -> list[dict[str, Any]]:
        start_at = time.time() + LEAD_S
        for s in group:
            s.send(
                {
                    "cmd": "run",
                    "start_at": start_at,
                    "warmup": self.warmup_s,
                    "window": window,
                }
            )
        begin = start_at + self.warmup_s
        view = self.sampler.over(begin, begin + window) if self.sampler else None
        results = []
        for s in group:
            msg = s.next(begin + window + 60 - time.time())
            if msg.get("event") != "result":
                msg = {"event": "result", "oom": False, "error": f"no result ({msg})"}
            results.append(msg)
        run = {
            "run": "+".join(s.name for s in group),
            "names": [s.name for s in group],
            "pids": [s.pid for s in group],
            "results": results,
            "view": view,
        }
        self.runs.append(run)
        return results

    def measure_solo(self, deadline: float) -> None:
        for s in self.servers:
            if time.monotonic() + LEAD_S + self.warmup_s + self.solo_s > deadline:
                self.log(f"solo: out of time before {s.name}")
                return
            (r,) = self._measure([s], self.solo_s)
            if r.get("oom") or r.get("error"):
                self.failed[s.name] = r.get("error", "oom")
                self.log(f"solo {s.name}: {r.get('error')}")
                continue
            self.solo[s.name] = r["rate"]
            view = self.runs[-1]["view"] or {}
            proc = view.get("processes", {}).get(s.pid, {})
            sm = proc.get("sm_util")
            busy = sm if sm is not None else view.get("util_gpu")
            self.solo_view[s.name] = {
                "busy_fraction": round(busy / 100, 4) if busy is not None else "",
                "memory_mib": proc.get("memory_mib") or round(s.memory_mib),
                "power_w": round(view["power_w"], 1) if view.get("power_w") else "",
            }
            self.log(f"solo {s.name}: {r['rate']:.2f} steps/s")
            self.write()

    def order(
        self, done: Collection[tuple[str, str]] = ()
    ) -> list[tuple[Server, Server]]:
        """Pairs of different families, one order each, every workload early
        (round-robin rounds), then the same pairs in the reverse order. Pairs in
        ``done`` ((job_a, job_b) measured by an earlier run) are left out, and
        pairs measured in neither order come before the other reverse orders."""
        ready = [s for s in self.servers if s.name in self.solo]
        n = len(ready)
        slots: list[Server | None] = [*ready, None] if n % 2 else list(ready)
        rounds: list[tuple[Server, Server]] = []
        m = len(slots)
        for _ in range(m - 1):
            for i in range(m // 2):
                a, b = slots[i], slots[m - 1 - i]
                if a is not None and b is not None and a.model != b.model:
                    rounds.append((a, b))
            slots = [slots[0], slots[-1], *slots[1:-1]]
        seen = {frozenset((a.name, b.name)) for a, b in rounds}
        rest = [
            (a, b)
            for a, b in itertools.combinations(ready, 2)
            if frozenset((a.name, b.name)) not in seen and a.model != b.model
        ]
        first = rounds + rest
        order = first + [(b, a) for a, b in first]
        todo = [(a, b) for a, b in order if (a.name, b.name) not in done]
        return sorted(todo, key=lambda ab: (ab[1].name, ab[0].name) in done)

    def measure_pairs(
        self,
        deadline: float,
        done: Collection[tuple[str, str]] = (),
    ) -> None:
        for a, b in self.order(done):
            if time.monotonic() + LEAD_S + self.warmup_s + self.pair_s + 1 > deadline:
                self.log("pairs: out of time")
                return
            ra, rb = self._measure([a, b], self.pair_s)
            self.pairs.append(self._pair_row(a, b, ra, rb))
            self.write()
            row = self.pairs[-1]
            if row["feasible"]:
                r_ab, r_ba = 1 / max(row["norm_a"], 1e-9), 1 / max(row["norm_b"], 1e-9)
                self.log(
                    f"pair {a.name} + {b.name}: r_AB {r_ab:.2f}, r_BA {r_ba:.2f}, "
                    f"r_AB*r_BA < r_AB+r_BA: {r_ab * r_ba < r_ab + r_ba}"
                )
            else:
                self.log(f"pair {a.name} + {b.name}: did not fit ({row['error']})")

    def _pair_row(
        self, a: Server, b: Server, ra: dict[str, Any], rb: dict[str, Any]
    ) -> dict[str, Any]:
        iso_a, iso_b = self.solo[a.name], self.solo[b.name]
        feasible = not (
            ra.get("oom") or rb.get("oom") or ra.get("error") or rb.get("error")
        )
        col_a = ra["rate"] if feasible else 0.0
        col_b = rb["rate"] if feasible else 0.0
        norm_a = round(col_a / iso_a, 4) if iso_a else 0.0
        norm_b = round(col_b / iso_b, 4) if iso_b else 0.0
        return {
            "worker_type": self.gpu,
            "gpu_type": self.gpu,
            "consolidated": 1,
            "job_a": a.name,
            "scale_factor_a": 1,
            "job_b": b.name,
            "scale_factor_b": 1,
            "isolated_a": iso_a,
            "isolated_b": iso_b,
            "colocated_a": col_a,
            "colocated_b": col_b,
            "norm_a": norm_a,
            "norm_b": norm_b,
            "combined_norm": round(norm_a + norm_b, 4),
            "feasible": int(feasible),
            "n_at_isolated": int(col_a == iso_a) + int(col_b == iso_b),
            "error": "; ".join(str(r.get("error")) for r in (ra, rb) if r.get("error")),
        }

    def write(self) -> None:
        g = self.gpu
        _csv(self.out / f"{g}_colocation_pairs.csv", PAIR_COLUMNS, self.pairs)
        _csv(
            self.out / f"{g}_isolated_throughputs.csv",
            ISOLATED_COLUMNS,
            [
                {
                    "worker_type": g,
                    "gpu_type": g,
                    "consolidated": 1,
                    "job_type": name,
                    "scale_factor": 1,
                    "isolated_steps_per_sec_simulation_json": rate,
                    "isolated_steps_per_sec_physical_json": rate,
                }
                for name, rate in self.solo.items()
            ],
        )
        _csv(
            self.out / f"{g}_solo_nvml.csv",
            ["workload", "busy_fraction", "memory_mib", "power_w"],
            [{"workload": k, **v} for k, v in self.solo_view.items()],
        )
        rows = []
        for run in self.runs:
            view = run["view"] or {}
            for name, pid, res in zip(
                run["names"], run["pids"], run["results"], strict=True
            ):
                proc = view.get("processes", {}).get(pid, {})
                rows.append(
                    {
                        "run": run["run"],
                        "workload": name,
                        "pid": pid,
                        "steps_per_s": res.get("rate", ""),
                        "sm_util": _r(proc.get("sm_util")),
                        "memory_mib": proc.get("memory_mib", ""),
                        "gpu_util": _r(view.get("util_gpu")),
                        "power_w": _r(view.get("power_w")),
                        "error": res.get("error", ""),
                    }
                )
        _csv(
            self.out / f"{g}_runs_nvml.csv",
            [
                "run",
                "workload",
                "pid",
                "steps_per_s",
                "sm_util",
                "memory_mib",
                "gpu_util",
                "power_w",
                "error",
            ],
            rows,
        )


def _r(v: float | None) -> float | str:
    return round(v, 2) if v is not None else ""


def _csv(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
