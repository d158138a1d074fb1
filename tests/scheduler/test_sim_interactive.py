"""Interactive jobs in the simulator: a canonical trace marks one with the
``interactive`` class (``priority`` column), the replay gives it the policy's
interactive treatment; and ``bench/interactive_wait.py``'s trace (pure)."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig
from scheduler.sim.engine import SimOptions, Simulator
from scheduler.sim.prepare import PrepareOptions, prepare
from scheduler.sim.trace import read_trace

BENCH = Path(__file__).resolve().parents[2] / "bench"
HEADER = "job_id,submit_time,num_gpus,duration,user,priority,time_limit,checkpointable"


def replay(tmp_path: Path, policy: str, *, ckpt: int):
    # 1 GPU: a 10,000 s batch job at 0; a 100 s interactive job at 1,000
    trace = tmp_path / "t.csv"
    trace.write_text(
        f"{HEADER}\n"
        f"batch,0,1,10000,b,normal,86400,{ckpt}\n"
        "lab,1000,1,100,s,interactive,7200,0\n",
        encoding="utf-8",
    )
    nodes = parse_cluster_spec("1x1:A100-80GB")
    fmt, raw = read_trace(str(trace))
    jobs = prepare(fmt, raw, nodes, None, PrepareOptions()).jobs
    Simulator(jobs, nodes, PolicyConfig(name=policy), SimOptions()).run()
    return {j.name: j for j in jobs}


def test_an_interactive_row_preempts_a_checkpointable_batch_job(tmp_path):
    jobs = replay(tmp_path, "gpulab", ckpt=1)
    lab, batch = jobs["lab"], jobs["batch"]
    assert lab.priority_class == "interactive"
    # the batch job has run 1,000 s >= GPULAB_PREEMPT_MIN_RUN: stopped with 30 s
    # of grace, the interactive job starts then
    assert lab.first_start == 1030 and lab.preemptions == 0
    # no checkpoint yet (one per 1,800 s of progress): it restarts from scratch
    # when the interactive job ends
    assert batch.preemptions == 1 and batch.end == 1130 + 10000


@pytest.mark.parametrize(("policy", "ckpt"), [("gpulab", 0), ("slurm", 1)])
def test_without_a_checkpointable_job_or_under_slurm_it_waits(tmp_path, policy, ckpt):
    jobs = replay(tmp_path, policy, ckpt=ckpt)
    assert jobs["lab"].first_start == 10000
    assert jobs["batch"].preemptions == 0


def load_bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(
            "interactive_wait", BENCH / "interactive_wait.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_the_bench_s_trace_differs_between_fractions_only_in_checkpointable(tmp_path):
    bench = load_bench()
    args = argparse.Namespace(load=1.2, students=3, gap_min=20.0, batch_users=6)
    pool = [(1, 3600.0), (4, 36000.0), (2, 600.0)]
    got = {}
    for f in (0.0, 0.5, 1.0):
        bench.write_trace(tmp_path / f"{f}.csv", 7, f, pool, 8, args)
        got[f] = rows(tmp_path / f"{f}.csv")
    strip = [{k: v for k, v in r.items() if k != "checkpointable"} for r in got[0.0]]
    for f in (0.5, 1.0):
        assert [
            {k: v for k, v in r.items() if k != "checkpointable"} for r in got[f]
        ] == strip
    batch = [i for i, r in enumerate(got[0.0]) if r["priority"] != "interactive"]
    inter = [i for i, r in enumerate(got[0.0]) if r["priority"] == "interactive"]
    assert inter and batch
    ck = {f: {i for i in batch if got[f][i]["checkpointable"] == "1"} for f in got}
    assert ck[0.0] == set() and ck[1.0] == set(batch)
    assert ck[0.5] < ck[1.0] and ck[0.5]
    assert all(got[1.0][i]["checkpointable"] == "0" for i in inter)
    assert all(
        got[0.0][i]["time_limit"] == "7200" and got[0.0][i]["num_gpus"] == "1"
        for i in inter
    )
    # the backlog fills twice the cluster at t=0
    assert (
        sum(
            int(got[0.0][i]["num_gpus"])
            for i in batch
            if got[0.0][i]["submit_time"] == "0.0"
        )
        >= 16
    )


def test_the_bench_rejects_bad_options(capsys):
    bench = load_bench()
    assert bench.main(["--fractions", "0,2"]) == 2
    assert "--fractions" in capsys.readouterr().err
    assert bench.main(["--policies", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
