"""Every row of a trace accounted for, the all-skipped exit, Jain's index over
users (pure, no DB)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig
from scheduler.sim.cli import main
from scheduler.sim.engine import Simulator
from scheduler.sim.jobs import SimJob
from scheduler.sim.metrics import jain, summarize

if TYPE_CHECKING:
    from pathlib import Path

GAVEL = "vc,job_type,total_steps,arrival_time_s,scale_factor\n"
THROUGHPUTS_K80 = """worker_type,gpu_type,consolidated,job_type,scale_factor,\
isolated_steps_per_sec_simulation_json,isolated_steps_per_sec_physical_json
k80,k80,1,ResNet,1,2.0,9
v100,v100,1,ResNet,1,4.0,9
"""


def sim_job(i: int, gpus: int, duration: float, user: str, limit: float) -> SimJob:
    return SimJob(
        id=i,
        name=str(i),
        submit=0.0,
        gpus=gpus,
        ref_duration=duration,
        user=user,
        group="g",
        label="",
        priority_class="normal",
        time_limit=limit,
        user_limit=True,
    )


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CANONICAL_HEADER = "job_id,submit_time,num_gpus,duration,time_limit,user,group\n"


def canonical(tmp_path: Path) -> str:
    # 10 rows: 6 in group a (one too wide for 1x4), 4 in group b; one job of a
    # times out (limit 30 s < 100 s)
    rows = [
        "a1,0,1,50,,u1,a",
        "a2,5,2,100,30,u2,a",
        "a3,9,8,10,,u1,a",
        "a4,12,1,20,,u3,a",
        "a5,15,4,40,,u2,a",
        "a6,20,1,10,,u1,a",
        *(f"b{i},{i},1,10,,u9,b" for i in range(4)),
    ]
    return write(tmp_path, "t.csv", CANONICAL_HEADER + "\n".join(rows) + "\n")


@pytest.mark.parametrize("policy", ["fifo", "first-fit", "slurm", "gpulab", "tiresias"])
def test_every_row_is_accounted_for(tmp_path, capsys, policy):
    out = tmp_path / "out.json"
    code = main(
        ["--trace", canonical(tmp_path), "--cluster", "1x4:p100", "--vc", "a",
         "--policy", policy, "--out", str(out), "--quiet"]
    )  # fmt: skip
    assert code == 0
    got = json.loads(out.read_text())
    assert got["accounted"] == {
        "trace_rows": 10,
        "outside_case": {"other_vc": 4},
        "skipped": {"more_gpus_than_cluster": 1},
        "completed": 4,
        "timed_out": 1,
        "unfinished": 0,
    }
    assert got["avg_jct_over"]["jobs"] == got["jobs"] == 5
    err = capsys.readouterr().err
    assert "skipped 1 of 6 rows of the case: more_gpus_than_cluster 1" in err


def test_max_jobs_cut_is_accounted_as_outside_the_case(tmp_path):
    out = tmp_path / "out.json"
    code = main(
        ["--trace", canonical(tmp_path), "--cluster", "1x4:p100", "--max-jobs", "3",
         "--policy", "fifo", "--out", str(out), "--quiet"]
    )  # fmt: skip
    assert code == 0
    a = json.loads(out.read_text())["accounted"]
    assert a["outside_case"] == {"beyond_max_jobs": 7}
    assert a["completed"] + a["timed_out"] + a["unfinished"] == 3


def test_unfinished_jobs_are_counted_in_the_summary():
    # a 16-GPU job on 8 GPUs never starts: unfinished, out of the averages
    jobs = [
        sim_job(1, 16, 10, "u", 100),
        sim_job(2, 1, 10, "u", 100),
    ]
    sim = Simulator(jobs, parse_cluster_spec("2x4:p100"), PolicyConfig(name="fifo"))
    out = summarize(sim.run())
    assert out["unfinished"] == {"no_such_shape": 1}
    assert out["avg_jct_over"]["jobs"] == 1 and out["avg_jct_s"] == 10


def test_a_throughput_table_matching_no_gpu_model_exits_non_zero(tmp_path, capsys):
    trace = write(tmp_path, "g.csv", GAVEL + "x,ResNet,100,0,1\nx,ResNet,50,5,1\n")
    table = write(tmp_path, "tp.csv", THROUGHPUTS_K80)
    code = main(["--trace", trace, "--cluster", "1x4:p100", "--throughputs", table])
    assert code == 2
    err = capsys.readouterr().err
    assert "every one of the 2 rows of the case was skipped" in err
    assert "no_throughput_for_gpu_count: 2" in err
    assert "no rows for the cluster's GPU model(s) p100 (its models: k80, v100)" in err


def test_a_virtual_cluster_that_is_not_in_the_trace_exits_non_zero(tmp_path, capsys):
    code = main(["--trace", canonical(tmp_path), "--cluster", "1x4:p100", "--vc", "zz"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no row of the trace is in virtual cluster 'zz'" in err
    assert "its virtual clusters: a, b" in err


def test_every_row_too_wide_names_the_cluster_size(tmp_path, capsys):
    path = write(
        tmp_path, "w.csv", "job_id,submit_time,num_gpus,duration\na,0,8,10\nb,1,9,10\n"
    )
    assert main(["--trace", path, "--cluster", "1x4:p100"]) == 2
    err = capsys.readouterr().err
    assert "the cluster has 4 GPUs and the smallest job asks for 8" in err


def test_jain_over_users_reads_each_users_mean_bounded_slowdown():
    # 1 GPU, first-fit. u1: j1 (100 s) at 0 runs 0-100, slowdown 1; u2: j2 (100 s)
    # at 0 waits, runs 100-200: slowdown 2; j3 (5 s) at 0 runs 200-205: JCT 205 /
    # max(5, 10) = 20.5. Per user: u1 1, u2 (2 + 20.5) / 2 = 11.25.
    def job(i, user, duration):
        return sim_job(i, 1, duration, user, 1000)

    jobs = [job(1, "u1", 100), job(2, "u2", 100), job(3, "u2", 5)]
    sim = Simulator(
        jobs, parse_cluster_spec("1x1:p100"), PolicyConfig(name="first-fit")
    )
    out = summarize(sim.run())
    assert [j.end for j in jobs] == [100, 200, 205]
    assert out["users"] == 2
    assert out["jain_fairness_users"] == pytest.approx(jain([1.0, 11.25]))
    assert out["jain_fairness"] == pytest.approx(1.0)  # one group


def test_a_timed_out_job_counts_no_faster_than_alone_for_users():
    # 200 s of work, limit 50 s: JCT 50 < its run time; its slowdown counts as 1
    jobs = [
        sim_job(1, 1, 200, "u1", 50),
        sim_job(2, 1, 100, "u2", 1000),
    ]
    sim = Simulator(jobs, parse_cluster_spec("1x2:p100"), PolicyConfig(name="fifo"))
    out = summarize(sim.run())
    assert out["timeouts"] == 1
    assert out["jain_fairness_users"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("option", "value", "first"),
    [
        ("--weight-fairshare", "1000", "light"),
        ("--weight-fairshare", "0", "heavy"),
        ("--fairshare-user", "1", "light"),
        ("--fairshare-user", "0", "heavy"),
    ],
)
def test_the_fair_share_weight_reaches_the_replay(tmp_path, option, value, first):
    """``--weight-fairshare`` (GPULAB_WEIGHT_FAIRSHARE) and ``--fairshare-user``
    (GPULAB_FAIRSHARE_USER): on one GPU, after the heavy user's first job (over
    two days), the light user's job goes first under fair share; with either
    at 0 (one group: only users could tell the jobs apart) the heavy user's
    older job with the shorter plan does."""
    rows = ["h1,0,1,200000,400000,heavy,g", "h2,1,1,100,2000,heavy,g",
            "l1,2,1,100,86400,light,g"]  # fmt: skip
    trace = write(tmp_path, "f.csv", CANONICAL_HEADER + "\n".join(rows) + "\n")
    out = tmp_path / "out.json"
    code = main(
        ["--trace", trace, "--cluster", "1x1:p100", "--policy", "gpulab",
         option, value, "--out", str(out), "--quiet"]
    )  # fmt: skip
    assert code == 0
    got = json.loads(out.read_text())
    key = option.removeprefix("--").replace("-", "_")
    assert got["options"][key] == float(value)
    waits = got["queue_s_by_job"]
    assert len(waits) == 3
    heavy, light = waits["2"], waits["3"]  # the job ids in submit order from 1
    assert (heavy < light) == (first == "heavy"), waits
