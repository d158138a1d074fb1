"""The prepared real-GPU run (bench/gpu) on CPU: the fake workload, the real agent
over a simulated GPU, the harness's tables, and the agent check's comparison.

The script runs as it does on the GPU machine (a subprocess, real workload servers,
the real agent against the recording endpoint), with short windows; no torch."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.gpu.agent_check import AgentCheck
from bench.gpu.pairs import ISOLATED_COLUMNS, PAIR_COLUMNS, Harness

ROOT = Path(__file__).resolve().parents[2]
GAVEL_PAIR_HEADER = (
    "worker_type,gpu_type,consolidated,job_a,scale_factor_a,job_b,scale_factor_b,"
    "isolated_a,isolated_b,colocated_a,colocated_b,norm_a,norm_b,combined_norm,"
    "feasible,n_at_isolated"
)


def run_script(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> Path:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu.script",
            "--out",
            str(out),
            "--fake",
            "--work-dir",
            str(tmp_path / "work"),
            "--deadline",
            "40",
            "--job-seconds",
            "1",
            "--warmup",
            "0.2",
            "--solo",
            "0.6",
            "--pair",
            "0.8",
            "--agent-report-at",
            "2",
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_the_run_measures_pairs_checks_the_agent_and_goes_on_past_a_failure(
    tmp_path: Path,
) -> None:
    out = run_script(tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    # The gpu tests ran and failed (no driver here); the steps after them ran.
    assert summary["steps"]["gpu_tests"]["ok"]
    assert summary["gpu_tests"]["exit"] != 0
    assert "NvmlUnavailable" in "\n".join(summary["gpu_tests"]["tail"])
    assert summary["steps"]["solo"]["ok"] and summary["steps"]["pairs"]["ok"]
    assert summary["nvml_support"]["not_supported"] == ["nvmlDeviceGetNvLinkState"]

    # Gavel's formats, exactly.
    pairs_csv = out / "fake_colocation_pairs.csv"
    assert pairs_csv.read_text().splitlines()[0] == GAVEL_PAIR_HEADER
    assert GAVEL_PAIR_HEADER.split(",") == PAIR_COLUMNS
    iso = rows(out / "fake_isolated_throughputs.csv")
    assert list(iso[0]) == ISOLATED_COLUMNS
    solo = {
        r["job_type"]: float(r["isolated_steps_per_sec_simulation_json"]) for r in iso
    }
    assert set(solo) == {
        "FakeA (batch size 1)", "FakeB (batch size 1)", "FakeC (batch size 2)"
    }  # fmt: skip
    assert all(rate > 20 for rate in solo.values())

    # Three pairs, one order each, then the reverse orders: the fakes take turns
    # on one lock, so together they run at most one fake's solo rate (less the
    # hand-overs; the lock is not fair, so one may take more than half).
    pairs = rows(pairs_csv)
    ordered = [(r["job_a"], r["job_b"]) for r in pairs]
    assert len(ordered) == 6 and len(set(ordered)) == 6
    assert {frozenset(p) for p in ordered[:3]} == {frozenset(p) for p in ordered[3:]}
    assert ordered[3:] == [(b, a) for a, b in ordered[:3]]
    for r in pairs:
        assert r["feasible"] == "1" and r["worker_type"] == "fake"
        assert float(r["isolated_a"]) == solo[r["job_a"]]
        norm_a = float(r["colocated_a"]) / float(r["isolated_a"])
        assert float(r["norm_a"]) == pytest.approx(norm_a, abs=1e-4)
        assert 0 < float(r["norm_a"]) < 1 and 0 < float(r["norm_b"]) < 1
        assert 0.4 < float(r["combined_norm"]) < 1.15
    runs = {r["run"] for r in rows(out / "fake_runs_nvml.csv")}
    assert len(runs) == 9  # three solo runs and six pairs
    assert {r["workload"] for r in rows(out / "fake_solo_nvml.csv")} == set(solo)

    # The agent's every frame parsed with the protocol's models; its job ran,
    # reported progress to its total and exited; processes attributed right.
    check = json.loads((out / "agent_check.json").read_text())
    assert check["final"] is True
    assert check["invalid_frames"] == 0
    assert check["frames"]["hello"] == 1 and check["frames"]["metrics"] >= 5
    assert [e["exit_code"] for e in check["job_exits"]] == [0]
    last = check["progress"][-1]
    assert last["total"] and last["step"] == last["total"]
    procs = check["processes"]
    assert procs["attribution_n"] > 0
    assert procs["attribution_ok"] == procs["attribution_n"]
    assert check["smi_error"] == "nvidia-smi not found"
    assert rows(out / "agent_compare.csv")


def test_a_workload_that_does_not_fit_is_reported_and_the_rest_are_measured(
    tmp_path: Path,
) -> None:
    out = run_script(
        tmp_path, "--no-agent", "--no-tests", env={"GPULAB_FAKE_GPU_MIB": "2500"}
    )
    summary = json.loads((out / "summary.json").read_text())
    failed = summary["harness"]["failed"]
    assert len(failed) == 1
    assert "fake GPU" in next(iter(failed.values()))
    assert len(summary["harness"]["solo"]) == 2
    pairs = rows(out / "fake_colocation_pairs.csv")
    assert len(pairs) == 2  # the two that fit, both orders
    assert not ({r["job_a"] for r in pairs} & set(failed))
    assert "gpu_tests" not in summary["steps"]
    assert not (out / "agent_check.json").exists()


def server(name: str) -> Any:
    return SimpleNamespace(name=name, model=name.lower())


def test_pairs_measured_in_neither_order_come_first_after_an_earlier_run() -> None:
    h = Harness("h200", Path("/nonexistent"), None)
    h.servers = [server(n) for n in "ABCD"]
    h.solo = dict.fromkeys("ABCD", 1.0)
    first = [(a.name, b.name) for a, b in h.order()]
    assert len(first) == 12
    # Every workload in the first round; each pair once before any reverse order.
    assert {n for pair in first[:2] for n in pair} == set("ABCD")
    assert first[6:] == [(b, a) for a, b in first[:6]]
    done = set(first[:4])
    later = [(a.name, b.name) for a, b in h.order(done)]
    assert not set(later) & done
    assert later[:2] == first[4:6]  # never measured in either order
    assert set(later[2:4]) == {(b, a) for a, b in first[4:6]}
    assert set(later[4:]) == {(b, a) for a, b in done}


# ---------------------------------------------------------------- the comparison


def metrics_frame(seq: int, t: float, **gpu: Any) -> dict[str, Any]:
    sample = {"index": 0, "uuid": "GPU-0", "processes": [], **gpu}
    return {"type": "metrics", "seq": seq, "data": {"sampled_at": t, "gpus": [sample]}}


def smi_reading(
    t: float, apps: list[dict[str, str]] | None = None, **values: float
) -> tuple[float, list[dict[str, str]], list[dict[str, str]]]:
    gpu = {"uuid": "GPU-0", **{k: str(v) for k, v in values.items()}}
    return (t, [gpu], apps or [])


def checker(frames: list[dict[str, Any]], readings: list[Any]) -> AgentCheck:
    check = AgentCheck(ROOT, Path("/nonexistent"), None)
    check.started_at = 1000.0
    check.recorder.frames = frames
    check.smi.readings = readings
    check.smi.error = ""
    return check


def test_the_comparison_flags_what_differs_from_nvidia_smi() -> None:
    proc = {"pid": 42, "used_memory_mib": 5992, "attempt_id": 7}
    frames = [
        metrics_frame(
            1, 1001.0, memory_used_mib=29088, power_w=600.0, temperature_c=55.0,
            util_gpu=98.0, processes=[proc],
        ),
        metrics_frame(
            2, 1002.0, memory_used_mib=28480, power_w=640.0, temperature_c=57.0,
            util_gpu=98.0, processes=[proc],
        ),
    ]  # fmt: skip
    apps = [{"pid": "42", "gpu_uuid": "GPU-0", "used_memory": "5992"}]
    smi: dict[str, Any] = {
        "memory.used": 28474, "power.draw": 603.0, "temperature.gpu": 55,
        "utilization.gpu": 98,
    }  # fmt: skip
    check = checker(
        frames, [smi_reading(1001.1, apps, **smi), smi_reading(1002.2, **smi)]
    )
    check.recorder.expected = {(1, 42): 7, (2, 42): None}
    summary, table = check.report()
    checks = summary["checks"]
    # 614 MiB over (NVML's version 1 on an H200) fails; 6 MiB passes.
    assert (checks["memory_used_mib"]["n"], checks["memory_used_mib"]["ok"]) == (2, 1)
    # 3 W off passes; 37 W off (over 5 % of 603) fails. 2 degrees off fails.
    assert checks["power_w"]["ok"] == 1 and checks["temperature_c"]["ok"] == 1
    procs = summary["processes"]
    # Frame 2: the agent lists pid 42, nvidia-smi none at that moment.
    assert (procs["frames"], procs["pids_equal"]) == (2, 1)
    assert (procs["memory_n"], procs["memory_ok"]) == (1, 1)
    # pid 42 was the job's in frame 1 and foreign in frame 2: one mismatch.
    assert (procs["attribution_n"], procs["attribution_ok"]) == (2, 1)
    assert procs["mismatches"] == [{"pid": 42, "reported": 7, "expected": None}]
    assert [r["smi_dt"] for r in table] == [0.1, 0.2]


def test_utilisation_windows_against_the_nearest_and_every_reading() -> None:
    """One nvidia-smi reading that caught an idle instant moves a 10-reading
    window's mean by 10 points; among 20 readings, by 5."""
    frames = [metrics_frame(n, 1000.0 + n, util_gpu=100.0) for n in range(10)]
    nearest = [
        smi_reading(1000.0 + n + 0.1, **{"utilization.gpu": 0 if n == 3 else 100})
        for n in range(10)
    ]
    between = [
        smi_reading(1000.0 + n + 0.6, **{"utilization.gpu": 100}) for n in range(10)
    ]
    summary, _ = checker(frames, nearest + between).report()
    assert summary["checks"]["util_10s"] == {"n": 1, "ok": 0, "all_ok": False}
    assert summary["checks"]["util_10s_all"] == {"n": 1, "ok": 1, "all_ok": True}
