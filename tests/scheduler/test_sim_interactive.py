"""Interactive jobs in the simulator: a canonical trace marks one with the
``interactive`` class (``priority`` column), the replay gives it the policy's
interactive treatment; and ``bench/interactive_wait.py``'s trace (pure)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig
from scheduler.sim.engine import SimOptions, Simulator
from scheduler.sim.prepare import PrepareOptions, prepare
from scheduler.sim.trace import read_trace
from tests.bench_scripts import load_bench

if TYPE_CHECKING:
    from pathlib import Path

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


ARGS = argparse.Namespace(load=1.2, students=3, gap_min=20.0, batch_users=6)
POOL = [(1, 3600.0), (4, 36000.0), (2, 600.0)]


def test_the_bench_s_batch_jobs_differ_between_fractions_only_in_checkpointable():
    bench = load_bench("interactive_wait")
    got = {f: bench.batch_rows(7, f, POOL, 8, ARGS) for f in (0.0, 0.5, 1.0)}

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "checkpointable"} for r in rows]

    assert strip(got[0.5]) == strip(got[0.0]) == strip(got[1.0])
    ck = {
        f: {r["job_id"] for r in rows if r["checkpointable"]} for f, rows in got.items()
    }
    assert ck[0.0] == set() and ck[1.0] == {r["job_id"] for r in got[0.0]}
    assert set() < ck[0.5] < ck[1.0]
    # the backlog fills twice the cluster at t=0
    assert sum(r["num_gpus"] for r in got[0.0] if r["submit_time"] == "0.0") >= 16


def test_a_student_opens_the_next_session_a_gap_after_the_last_one_ended():
    bench = load_bench("interactive_wait")
    plans = {"s": [(100.0, 600.0), (50.0, 900.0), (70.0, 700.0)]}
    submits = bench.open_loop(plans)
    assert submits == {"s": [100.0, 750.0, 1720.0]}
    rows = bench.session_rows(plans, submits)
    assert [
        (r["job_id"], r["priority"], r["num_gpus"], r["time_limit"]) for r in rows
    ] == [
        ("s-0", "interactive", 1, "7200"),
        ("s-1", "interactive", 1, "7200"),
        ("s-2", "interactive", 1, "7200"),
    ]
    # s-0 waited 300 s: s-1 comes its 50 s gap after s-0's true end, 1,000
    nxt = bench.closed_loop(plans, submits, {"s-0": 1000.0, "s-1": 1950.0})
    assert nxt == {"s": [100.0, 1050.0, 2020.0]}
    # a session whose predecessor was not in the day is pushed out of it
    late = bench.closed_loop(plans, {"s": [100.0, bench.DAY_S, bench.DAY_S]}, {})
    assert bench.session_rows(plans, late) == [rows[0]]


def test_the_bench_settles_to_one_session_at_a_time(tmp_path):
    bench = load_bench("interactive_wait")
    args = argparse.Namespace(**vars(ARGS), cluster="1x2:A100-80GB", max_replays=30)
    # two students on 2 GPUs, one held by a 10-hour batch job
    batch = [
        {
            "job_id": "b0",
            "submit_time": "0.0",
            "num_gpus": 1,
            "duration": "36000.0",
            "user": "b",
            "group": "batch",
            "priority": "",
            "time_limit": "",
            "checkpointable": 0,
        }
    ]
    plans = {
        "student1": [(60.0, 3000.0)] * 30,
        "student2": [(120.0, 3000.0)] * 30,
    }
    run = bench.settle(tmp_path, 0, 0.0, "gpulab", batch, plans, args)
    assert run["sessions_over_cap"] == 0 and run["iterations"] > 1
    assert max(run["interactive_waits_s"]) > 0  # they queued behind each other


def test_the_bench_rejects_bad_options(capsys):
    bench = load_bench("interactive_wait")
    assert bench.main(["--max-replays", "0"]) == 2
    assert "--max-replays" in capsys.readouterr().err
    assert bench.main(["--fractions", "0,2"]) == 2
    assert "--fractions" in capsys.readouterr().err
    assert bench.main(["--policies", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
