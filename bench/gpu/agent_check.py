"""The real agent on this node's NVML, checked frame by frame against nvidia-smi.

``AgentCheck`` starts a recording websocket endpoint that plays the portal's side
(every frame parsed with the agent protocol's own models, invalid ones counted with
the reason; hello, acks and one ``job.launch`` of a workload as the portal would),
the agent itself (``python -m agents``, real NVML unless ``simulate`` names a spec)
and an ``nvidia-smi`` poller. ``report()`` pairs each metrics frame with the
nvidia-smi reading nearest in time and checks, per GPU:

- memory used within max(1 %, 16 MiB); power within max(5 %, 10 W); temperature
  within 1 degree C; utilisation averaged over 10-s windows within 5 points;
- processes: the same pids as ``--query-compute-apps``, the same memory (as above),
  and each attributed to the attempt whose job process is its ancestor (read from
  /proc when the frame arrives), none to a foreign process.

``not_supported(nvml)`` lists the NVML calls that raised ``NVMLError_NotSupported``
(and any other NVML error) through the agent's own reader on this GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

from agents import protocol as p
from agents.nvml import NvmlReader

ACKED = {"job.started", "job.exited", "job.log", "metrics", "job.progress"}
GPU_FIELDS = [
    "index",
    "uuid",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "utilization.gpu",
    "power.draw",
]
# Asked for when this nvidia-smi knows them (older ones refuse the whole query).
GPU_FIELDS_OPTIONAL = ["power.draw.average", "power.draw.instant"]
WINDOW_S = 10.0
# One nvidia-smi reading: (wall time, its GPUs' rows, its compute apps' rows).
Reading = tuple[float, list[dict[str, str]], list[dict[str, str]]]


def within(a: float, b: float, rel: float, floor: float) -> bool:
    return abs(a - b) <= max(rel * abs(b), floor)


# ---------------------------------------------------------------- nvidia-smi


class Smi:
    """Poll nvidia-smi every ``every_s`` in a thread: (wall time, gpus, apps)."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.readings: list[Reading]
        self.readings = []
        self.fields = list(GPU_FIELDS)
        self.error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if shutil.which("nvidia-smi") is None:
            self.error = "nvidia-smi not found"
            return
        try:
            self._query([*GPU_FIELDS, *GPU_FIELDS_OPTIONAL], "gpu")
            self.fields += GPU_FIELDS_OPTIONAL
        except (subprocess.CalledProcessError, ValueError):
            pass

    def _query(self, fields: list[str], what: str) -> list[dict[str, str]]:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--query-{what}={','.join(fields)}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        rows = []
        for line in out.strip().splitlines():
            values = [v.strip() for v in line.split(",")]
            if len(values) != len(fields):
                raise ValueError(f"nvidia-smi answered {line!r} to {fields}")
            rows.append(dict(zip(fields, values, strict=True)))
        return rows

    def start(self) -> None:
        if not self.error:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                before = time.time()
                gpus = self._query(self.fields, "gpu")
                apps = self._query(["pid", "gpu_uuid", "used_memory"], "compute-apps")
                self.readings.append(((before + time.time()) / 2, gpus, apps))
            except (subprocess.SubprocessError, ValueError, OSError) as exc:
                self.error = str(exc)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=15)

    def nearest(self, t: float) -> Reading | None:
        if not self.readings:
            return None
        return min(self.readings, key=lambda r: abs(r[0] - t))


# ---------------------------------------------------------------- the portal side


def ancestors(pid: int) -> list[int]:
    """pid and its parents up to init, read from /proc (empty if it is gone)."""
    chain: list[int] = []
    while pid > 1 and len(chain) < 64:
        chain.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return chain


@dataclass
class Recorder:
    """The portal's side of the agent protocol, recording what it receives."""

    launch: dict[str, Any] | None
    frames: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    started: dict[int, int] = field(default_factory=dict)  # job pid -> attempt
    expected: dict[tuple[int, int], int | None] = field(default_factory=dict)
    port: int = 0
    out_seq: int = 0
    # Set when the launched job's job.exited arrives (the run waits on it).
    job_exited: threading.Event = field(default_factory=threading.Event)

    async def handler(self, ws: ServerConnection) -> None:
        with contextlib.suppress(Exception):
            async for raw in ws:
                try:
                    msg = p.parse_agent_message(raw)
                except p.ProtocolError as exc:
                    self.invalid.append(str(exc)[:300])
                    continue
                frame = json.loads(raw)
                frame["received"] = time.time()
                self.frames.append(frame)
                if isinstance(msg, p.Metrics):
                    self._expect(msg)
                elif isinstance(msg, p.JobStarted):
                    self.started[msg.data.pid] = msg.data.attempt_id
                elif isinstance(msg, p.JobExited):
                    self.job_exited.set()
                if frame["type"] in ACKED:
                    await self.send(ws, "ack", {"seq": frame["seq"]})
                if isinstance(msg, p.Hello) and self.launch is not None:
                    launch = {**self.launch, "gpu_uuids": [msg.data.gpus[0].uuid]}
                    self.launch = None
                    await self.send(ws, "job.launch", launch)

    def _expect(self, msg: p.Metrics) -> None:
        """The attempt each process belongs to, by its ancestry, right now."""
        for gpu in msg.data.gpus:
            for proc in gpu.processes:
                owner = None
                for pid in ancestors(proc.pid):
                    if pid in self.started:
                        owner = self.started[pid]
                        break
                self.expected[(msg.seq, proc.pid)] = owner

    async def send(
        self, ws: ServerConnection, type_: str, data: dict[str, Any]
    ) -> None:
        self.out_seq += 1
        frame = {
            "type": type_,
            "v": p.PROTOCOL_VERSION,
            "seq": self.out_seq,
            "ts": time.time(),
            "data": data,
        }
        await ws.send(json.dumps(frame))


# ---------------------------------------------------------------- the check


class AgentCheck:
    """Recorder + agent + nvidia-smi poller; ``report()`` any time, ``stop()``."""

    def __init__(
        self,
        workdir: Path,
        state_dir: Path,
        job_command: str | None,
        simulate: str | None = None,
    ) -> None:
        launch = None
        if job_command:
            launch = {
                "attempt_id": 1,
                "attempt": 1,
                "job_id": 1,
                "name": "gpu-check",
                "command": job_command,
                "workdir": str(workdir),
                "env": {},
                "grace_s": 5,
            }
        self.recorder = Recorder(launch)
        self.smi = Smi()
        self.workdir, self.state_dir, self.simulate = workdir, state_dir, simulate
        self.loop = asyncio.new_event_loop()
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_log = state_dir / "agent.log"
        self.started_at = 0.0

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ready = threading.Event()

        def run_loop() -> None:
            asyncio.set_event_loop(self.loop)

            async def up() -> None:
                server = await serve(self.recorder.handler, "127.0.0.1", 0)
                self.recorder.port = server.sockets[0].getsockname()[1]
                ready.set()
                await asyncio.Event().wait()

            with contextlib.suppress(RuntimeError):
                self.loop.run_until_complete(up())

        threading.Thread(target=run_loop, daemon=True).start()
        ready.wait(10)
        self.smi.start()
        cmd = [
            sys.executable,
            "-m",
            "agents",
            "--server",
            f"ws://127.0.0.1:{self.recorder.port}",
            "--state-dir",
            str(self.state_dir / "state"),
            "--sample-interval",
            "1",
            "--heartbeat",
            "5",
            "--hostname",
            "gpu-check",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root-jobs")
        if self.simulate:
            cmd += ["--simulate", self.simulate]
        env = {**os.environ, "GPULAB_AGENT_TOKEN": "gpu-check"}
        self.started_at = time.time()
        with self.agent_log.open("wb") as log:
            self.agent = subprocess.Popen(
                cmd, cwd=self.workdir, env=env, stdout=log, stderr=log
            )

    def stop(self) -> None:
        if self.agent and self.agent.poll() is None:
            self.agent.terminate()
            try:
                self.agent.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        self.smi.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)

    # ------------------------------------------------------------ comparison

    def report(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(summary, one row per metrics frame and GPU) from what is recorded."""
        frames = list(self.recorder.frames)
        by_type: dict[str, int] = defaultdict(int)
        for f in frames:
            by_type[f["type"]] += 1
        rows: list[dict[str, Any]] = []
        checks: dict[str, list[bool]] = defaultdict(list)
        util_windows: dict[tuple[int, int], tuple[list[float], list[float]]] = (
            defaultdict(lambda: ([], []))
        )
        procs = {
            "frames": 0,
            "pids_equal": 0,
            "memory_ok": 0,
            "memory_n": 0,
            "attribution_ok": 0,
            "attribution_n": 0,
            "mismatches": [],
        }
        for f in frames:
            if f["type"] != "metrics":
                continue
            t = f["data"]["sampled_at"]
            near = self.smi.nearest(t)
            for gpu in f["data"]["gpus"]:
                row = {"t": round(t - self.started_at, 2), "gpu": gpu["index"]}
                row.update(
                    {
                        k: gpu.get(k)
                        for k in (
                            "memory_used_mib",
                            "power_w",
                            "temperature_c",
                            "util_gpu",
                            "sm_clock_mhz",
                        )
                    }
                )
                row["processes"] = " ".join(
                    f"{q['pid']}:{q.get('used_memory_mib')}:{q.get('attempt_id')}"
                    for q in gpu["processes"]
                )
                self._attribution(f, gpu, procs)
                if near is not None:
                    self._against_smi(gpu, near, t, row, checks, util_windows, procs)
                rows.append(row)
        # Utilisation over 10-s windows: the agent's samples against the frames'
        # nearest nvidia-smi readings ("util_10s") and against every reading in
        # the window ("util_10s_all": twice as many, so less of the difference is
        # which instants each one caught).
        uuids = {
            g["uuid"]: g["index"]
            for f in frames
            if f["type"] == "metrics"
            for g in f["data"]["gpus"]
        }
        every: dict[tuple[int, int], list[float]] = defaultdict(list)
        for t_smi, smi_gpus, _ in list(self.smi.readings):
            for g in smi_gpus:
                with contextlib.suppress(KeyError, ValueError):
                    window = int((t_smi - self.started_at) // WINDOW_S)
                    every[(uuids[g["uuid"]], window)].append(
                        float(g["utilization.gpu"])
                    )
        for name, reference in (("util_10s", 1), ("util_10s_all", 2)):
            checks[name] = [
                within(
                    mean(agent_u), mean(smi_u if reference == 1 else every[key]), 0, 5
                )
                for key, (agent_u, smi_u) in sorted(util_windows.items())
                if len(agent_u) >= 5 and smi_u and every[key]
            ]
        summary = {
            "seconds": round(time.time() - self.started_at, 1),
            "frames": dict(by_type),
            "invalid_frames": len(self.recorder.invalid),
            "invalid_examples": self.recorder.invalid[:5],
            "smi_readings": len(self.smi.readings),
            "smi_fields": self.smi.fields,
            "smi_error": self.smi.error,
            "agent_exit": self.agent.poll() if self.agent else None,
            "jobs_started": dict(self.recorder.started),
            "job_exits": [f["data"] for f in frames if f["type"] == "job.exited"],
            "progress": [f["data"] for f in frames if f["type"] == "job.progress"][-3:],
            "checks": {
                k: {"n": len(v), "ok": sum(v), "all_ok": all(v) if v else None}
                for k, v in checks.items()
            },
            "processes": procs,
        }
        return summary, rows

    def _attribution(
        self, f: dict[str, Any], gpu: dict[str, Any], procs: dict[str, Any]
    ) -> None:
        for q in gpu["processes"]:
            key = (f["seq"], q["pid"])
            if key not in self.recorder.expected:
                continue
            procs["attribution_n"] += 1
            want = self.recorder.expected[key]
            if q.get("attempt_id") == want:
                procs["attribution_ok"] += 1
            elif len(procs["mismatches"]) < 10:
                procs["mismatches"].append(
                    {"pid": q["pid"], "reported": q.get("attempt_id"), "expected": want}
                )

    def _against_smi(
        self,
        gpu: dict[str, Any],
        near: Reading,
        t: float,
        row: dict[str, Any],
        checks: dict[str, list[bool]],
        util_windows: dict[tuple[int, int], tuple[list[float], list[float]]],
        procs: dict[str, Any],
    ) -> None:
        t_smi, smi_gpus, apps = near
        smi = next((g for g in smi_gpus if g["uuid"] == gpu["uuid"]), None)
        if smi is None:
            return
        row["smi_dt"] = round(t_smi - t, 2)

        def num(key: str) -> float | None:
            try:
                return float(smi.get(key, ""))
            except ValueError:
                return None

        for ours, theirs, rel, floor in (
            ("memory_used_mib", "memory.used", 0.01, 16),
            ("power_w", "power.draw", 0.05, 10),
            ("temperature_c", "temperature.gpu", 0, 1),
        ):
            value, ref = gpu.get(ours), num(theirs)
            row["smi_" + theirs] = ref
            if value is not None and ref is not None:
                checks[ours].append(within(value, ref, rel, floor))
        for extra in GPU_FIELDS_OPTIONAL:
            row["smi_" + extra] = num(extra)
            if gpu.get("power_w") is not None and num(extra) is not None:
                checks["power_w vs " + extra].append(
                    within(gpu["power_w"], num(extra) or 0.0, 0.05, 10)
                )
        util, ref_util = gpu.get("util_gpu"), num("utilization.gpu")
        row["smi_utilization.gpu"] = ref_util
        if util is not None and ref_util is not None:
            window = int((t - self.started_at) // WINDOW_S)
            util_windows[(gpu["index"], window)][0].append(util)
            util_windows[(gpu["index"], window)][1].append(ref_util)
        theirs_apps = {
            int(a["pid"]): a["used_memory"]
            for a in apps
            if a["gpu_uuid"] == gpu["uuid"] and a["pid"].isdigit()
        }
        ours_apps = {q["pid"]: q.get("used_memory_mib") for q in gpu["processes"]}
        procs["frames"] += 1
        procs["pids_equal"] += int(set(ours_apps) == set(theirs_apps))
        for pid, mem in ours_apps.items():
            theirs = theirs_apps.get(pid, "")
            if mem is not None and theirs.replace(".", "").isdigit():
                procs["memory_n"] += 1
                procs["memory_ok"] += int(within(mem, float(theirs), 0.01, 16))


# ---------------------------------------------------------------- NVML support


class RecordingNvml:
    """pynvml, with every NVML error a call raised recorded by function name."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.raised: dict[str, set[str]] = defaultdict(set)
        self.ok: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = value(*args, **kwargs)
            except self._nvml.NVMLError as exc:
                self.raised[name].add(type(exc).__name__)
                raise
            self.ok.add(name)
            return result

        return call


def not_supported(nvml: Any, samples: int = 3) -> dict[str, Any]:
    """Run the agent's reader (hello and ``samples`` samples) over a recording
    pynvml: which calls raised what, which always answered."""
    rec = RecordingNvml(nvml)
    reader = NvmlReader(rec)
    try:
        reader.gpus()
        for _ in range(samples):
            reader.sample(lambda _pid: None)
    finally:
        reader.close()
    return {
        "raised": {k: sorted(v) for k, v in sorted(rec.raised.items())},
        "not_supported": sorted(
            k for k, v in rec.raised.items() if "NVMLError_NotSupported" in v
        ),
        "answered": sorted(rec.ok),
    }


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, columns)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
