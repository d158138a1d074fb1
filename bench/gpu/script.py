"""The prepared real-GPU run (issue #26), in one command within a deadline.

``bash bench/gpu/run.sh`` on the GPU machine runs this with its output folder
(``$OUT``); each step writes its result there as soon as it has it, so a run stopped
at its limit still returns what it measured. In order:

1. GPU check (``nvidia-smi --query-gpu=name,driver_version,compute_mode,
   mig.mode.current``); in Exclusive_Process mode the pairs are skipped.
2. Imports: everything the steps need, under this Python; a failure is reported and
   the steps that still can run go on.
3. The agent check starts (``bench.gpu.agent_check``: the real agent, a recording
   endpoint, nvidia-smi) and runs beside everything after it; the endpoint launches
   one workload through the agent, so process attribution is checked on a real job.
   Its report is written at 60 s and again at the end.
4. The workload servers start (``bench.gpu.pairs``) while the ``gpu``-marked tests
   run, and the NVML calls the agent's reader makes are probed for support.
5. Solo rates, then pairs until the deadline (``--deadline``, s from the start).

Files in ``--out`` (at most 8 come back from the GPU machine): ``summary.json``,
``agent_check.json``, ``agent_compare.csv`` and the harness's four CSVs; ``run.sh``
adds ``log.txt``. ``--fake`` runs the same steps with the torch-free fake workload
and a simulated GPU for the agent (the CPU test in CI).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SUITE = ["fcn", "vgg19", "resnet50", "lstm", "transformer"]
IMPORTS = [
    "pydantic",
    "websockets",
    "pynvml",
    "pytest",
    "agents.agent",
    "agents.nvml",
    "bench.gpu.agent_check",
    "bench.gpu.pairs",
]
TORCH_IMPORTS = ["torch", "torchvision"]


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.summary: dict[str, Any] = {"fake": args.fake, "steps": {}}
        self.lock = threading.RLock()  # the 60-s agent report runs in a timer
        self.fake_lock = Path(args.work_dir) / "fake.lock"

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    def save(self) -> None:
        with self.lock:
            tmp = self.out / "summary.json.tmp"
            tmp.write_text(json.dumps(self.summary, indent=1, default=str))
            tmp.replace(self.out / "summary.json")

    def step(self, name: str, fn: Any, *args: Any) -> Any:
        """Run one step; a failure is recorded with its traceback and the run
        goes on."""
        start = time.monotonic()
        try:
            result = fn(*args)
            ok = True
        except Exception as exc:  # the next steps still run
            result = None
            ok = False
            self.summary.setdefault("errors", {})[name] = traceback.format_exc(limit=4)
            self.log(f"{name}: FAILED: {exc!r}")
        self.summary["steps"][name] = {
            "ok": ok,
            "seconds": round(time.monotonic() - start, 1),
        }
        self.save()
        return result

    # ------------------------------------------------------------ steps

    def gpu_check(self) -> dict[str, Any]:
        if self.args.fake:
            info = {"name": "fake", "compute_mode": "Default", "kind": "fake"}
        else:
            line = (
                subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-gpu=name,driver_version,compute_mode,mig.mode.current",
                        "--format=csv,noheader",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=30,
                )
                .stdout.strip()
                .splitlines()[0]
            )
            name, driver, mode, mig = (v.strip() for v in line.split(","))
            kind = next(
                (k for k in ("h200", "h100", "a100") if k in name.lower()),
                re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_"),
            )
            info = {
                "name": name,
                "driver": driver,
                "compute_mode": mode,
                "mig": mig,
                "kind": kind,
            }
        self.summary["gpu"] = info
        self.log(f"GPU: {info}")
        return info

    def imports(self) -> dict[str, str]:
        found = {}
        names = IMPORTS + ([] if self.args.fake else TORCH_IMPORTS)
        for name in names:
            try:
                mod = importlib.import_module(name)
                found[name] = str(getattr(mod, "__version__", "ok"))
            except Exception as exc:  # reported, the rest goes on
                found[name] = f"FAILED: {exc!r}"
                self.log(f"import {name}: FAILED: {exc!r}")
        found["python"] = sys.version.split()[0]
        self.summary["imports"] = found
        return found

    def gpu_tests(self) -> dict[str, Any]:
        """The ``gpu``-marked tests read NVML through ``agents.nvml`` alone: run
        without pytest-django and the test suite's conftest, whose Django setup
        would need every installed app (channels, DRF, ...) on this machine."""
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "tests/agents/test_gpu.py",
                "-p",
                "no:django",
                "-p",
                "no:cacheprovider",
                "--noconftest",
                "-o",
                "addopts=",
                "-q",
                "-rA",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
        result = {"exit": proc.returncode, "tail": tail}
        self.summary["gpu_tests"] = result
        self.log(f"gpu tests: exit {proc.returncode}: {tail[-1] if tail else ''}")
        return result

    def nvml(self) -> Any:
        if self.args.fake:
            from agents.simulate import SimNvml
            from agents.spec import parse_node_spec

            return SimNvml(parse_node_spec("1xA100-80GB"), hostname="fake")
        import pynvml  # type: ignore[import-untyped]

        return pynvml

    def probe(self) -> None:
        from bench.gpu.agent_check import not_supported

        self.summary["nvml_support"] = result = not_supported(self.nvml())
        self.log(f"NVML calls not supported: {result['not_supported']}")

    def job_command(self) -> str:
        model = "fake-a" if self.args.fake else "transformer"
        extra = f" --fake-lock {self.fake_lock}" if self.args.fake else ""
        return (
            f"{sys.executable} -m bench.gpu.workloads job --model {model}"
            f" --seconds {self.args.job_seconds}{extra}"
        )

    def start_agent_check(self) -> Any:
        from bench.gpu.agent_check import AgentCheck

        check = AgentCheck(
            ROOT,
            Path(self.args.work_dir) / "agent",
            self.job_command(),
            simulate="1xA100-80GB" if self.args.fake else None,
        )
        check.start()
        self.log(f"agent check: agent pid {check.agent.pid if check.agent else None}")
        return check

    def agent_report(self, check: Any, *, final: bool) -> None:
        from bench.gpu.agent_check import write_rows

        summary, rows = check.report()
        summary["final"] = final
        (self.out / "agent_check.json").write_text(
            json.dumps(summary, indent=1, default=str)
        )
        write_rows(self.out / "agent_compare.csv", rows)
        self.log(
            f"agent check ({summary['seconds']} s): frames {summary['frames']}, "
            f"invalid {summary['invalid_frames']}, checks {summary['checks']}, "
            f"processes {summary['processes']}"
        )

    # ------------------------------------------------------------ the run

    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        Path(self.args.work_dir).mkdir(parents=True, exist_ok=True)
        gpu = self.step("gpu_check", self.gpu_check) or {"kind": "unknown"}
        imported = self.step("imports", self.imports) or {}

        def usable(*names: str) -> bool:
            return all(
                not str(imported.get(n, "FAILED")).startswith("FAILED") for n in names
            )

        check = None
        if not self.args.no_agent and usable("agents.agent", "bench.gpu.agent_check"):
            check = self.step("agent_check_start", self.start_agent_check)
        harness = None
        if usable("bench.gpu.pairs") and (self.args.fake or usable("torch")):
            harness = self.step("servers_start", self.start_servers, gpu["kind"])
        if not self.args.no_tests and usable("pytest", "agents.nvml"):
            self.step("gpu_tests", self.gpu_tests)
        if usable("agents.nvml"):
            self.step("nvml_probe", self.probe)
        if check is not None:
            # The agent's own job ends before the solo runs (it would slow them).
            self.step("agent_job", self.wait_agent_job, check)
        if harness is not None:
            thread, h = harness
            thread.join(max(0.0, self.deadline - time.monotonic()))
            timer = None
            if check is not None:
                delay = self.args.agent_report_at - (time.time() - check.started_at)
                timer = threading.Timer(
                    max(0.0, delay),
                    self.step,
                    ("agent_check_60s", lambda: self.agent_report(check, final=False)),
                )
                timer.start()
            self.step("solo", h.measure_solo, self.deadline)
            if gpu.get("compute_mode") == "Exclusive_Process":
                self.log("compute mode Exclusive_Process: pairs skipped")
                self.summary["pairs_skipped"] = "Exclusive_Process"
            else:
                self.step("pairs", lambda: h.measure_pairs(self.deadline, self.done()))
            self.summary["harness"] = {
                "solo": h.solo,
                "failed": h.failed,
                "pairs": len(h.pairs),
            }
            if timer is not None:
                timer.join()
            h.close()
        if check is not None:
            self.step("agent_check_final", lambda: self.agent_report(check, final=True))
            check.stop()
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.save()
        self.log("done")
        return 0

    def start_servers(self, kind: str) -> tuple[threading.Thread, Any]:
        from agents.nvml import NvmlReader
        from bench.gpu.pairs import Harness, Sampler

        reader = NvmlReader(self.nvml())
        a = self.args
        h = Harness(
            kind,
            self.out,
            Sampler(reader),
            log=self.log,
            warmup_s=a.warmup,
            solo_s=a.solo,
            pair_s=a.pair,
        )
        models: list[tuple[str, int | None]]
        extra: list[str] = []
        if self.args.fake:
            models = [("fake-a", None), ("fake-b", None), ("fake-c", 2)]
            extra = ["--fake-lock", str(self.fake_lock), "--fake-step-s", "0.02"]
        else:
            models = [(m, None) for m in SUITE]
        thread = threading.Thread(
            target=h.start, args=(models, extra, self.args.server_wait), daemon=True
        )
        thread.start()
        return thread, h

    def done(self) -> set[tuple[str, str]]:
        """(job_a, job_b) of the pairs in ``--after`` (an earlier run's table)."""
        if not self.args.after:
            return set()
        with Path(self.args.after).open() as fh:
            return {(r["job_a"], r["job_b"]) for r in csv.DictReader(fh)}

    def wait_agent_job(self, check: Any) -> None:
        wait = min(self.args.job_seconds + 60, self.deadline - time.monotonic())
        if not check.recorder.job_exited.wait(max(0.0, wait)):
            self.log("agent job: no job.exited yet")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.script")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=270.0, help="s from the start")
    ap.add_argument("--fake", action="store_true", help="no GPU: fake workloads")
    ap.add_argument("--job-seconds", type=float, default=20.0)
    ap.add_argument("--server-wait", type=float, default=120.0)
    ap.add_argument("--work-dir", default="/tmp/gpulab-gpu-run")
    ap.add_argument("--warmup", type=float, default=5.0, help="s before counting")
    ap.add_argument("--solo", type=float, default=10.0, help="s counted alone")
    ap.add_argument("--pair", type=float, default=15.0, help="s counted in a pair")
    ap.add_argument("--no-agent", action="store_true", help="no agent check")
    ap.add_argument("--no-tests", action="store_true", help="no gpu tests")
    ap.add_argument(
        "--after", help="an earlier run's pairs CSV: measure the pairs it lacks first"
    )
    ap.add_argument(
        "--agent-report-at", type=float, default=60.0, help="first agent report, s"
    )
    args = ap.parse_args(argv)
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
