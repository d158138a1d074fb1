"""Trace readers, the seeded completions and the CLI (pure, no DB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import decide
from scheduler.sim import cli as sim_cli
from scheduler.sim.cli import main
from scheduler.sim.engine import Simulator
from scheduler.sim.prepare import PrepareOptions, prepare, user_limit_for
from scheduler.sim.trace import TraceError, read_throughputs, read_trace

ROOT = Path(__file__).resolve().parents[2]
THROUGHPUTS = """worker_type,gpu_type,consolidated,job_type,scale_factor,\
isolated_steps_per_sec_simulation_json,isolated_steps_per_sec_physical_json
p100,p100,1,ResNet,1,2.0,9
p100,p100,1,ResNet,4,4.0,9
p100_unconsolidated,p100,0,ResNet,8,5.0,9
p100,p100,1,LM,2,0.0,9
K80,k80,1,ResNet,1,1.0,9
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_canonical_reader(tmp_path):
    path = write(
        tmp_path,
        "t.csv",
        "job_id,submit_time,num_gpus,duration,user,group,gpu_mem_mib,time_limit,"
        "priority,shareable,extra\n"
        "a,0,1,100,alice,lab,8000,3600,high,1,zzz\n"
        "b,5.5,2,50,,,,,,,\n",
    )
    fmt, raw = read_trace(path)
    assert fmt == "canonical"
    a, b = raw
    assert (a.name, a.submit, a.gpus, a.duration) == ("a", 0, 1, 100)
    assert (a.user, a.group, a.gpu_mem_mib, a.time_limit) == (
        "alice",
        "lab",
        8000,
        3600,
    )
    assert a.priority == "high" and a.shareable
    assert b.time_limit is None and b.priority == "" and not b.shareable
    prepared = prepare(fmt, raw, parse_cluster_spec("1x4:p100"), None, PrepareOptions())
    ja, jb = prepared.jobs
    assert ja.user == "alice" and ja.time_limit == 3600 and ja.user_limit
    assert ja.priority_class == "high"
    assert jb.group == "default" and jb.user.startswith("default-u")
    assert jb.priority_class == "normal"
    # offered load: (100 + 2*50) GPU-s / (4 GPUs x 5.5 s)
    assert prepared.offered_load == pytest.approx(200 / 22)


def test_canonical_workload_steps_need_throughputs(tmp_path):
    path = write(
        tmp_path,
        "t.csv",
        "job_id,submit_time,num_gpus,workload,steps\nx,0,1,ResNet,10\n",
    )
    fmt, raw = read_trace(path)
    with pytest.raises(TraceError, match="--throughputs"):
        prepare(fmt, raw, parse_cluster_spec("1x4:p100"), None, PrepareOptions())
    table, column = read_throughputs(write(tmp_path, "thr.csv", THROUGHPUTS))
    assert column == "isolated_steps_per_sec_simulation_json"
    prepared = prepare(
        fmt, raw, parse_cluster_spec("1x4:p100"), table, PrepareOptions()
    )
    assert prepared.jobs[0].ref_duration == pytest.approx(5.0)


def test_philly_reader(tmp_path):
    path = write(
        tmp_path,
        "philly.csv",
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 07:01:55,66.0,1,66.0,vcA\n"
        "2017-10-09 07:00:55,100.0,2,200.0,vcB\n"
        "2017-10-09 07:03:55,30.0,1,30.0,vcA\n",
    )
    fmt, raw = read_trace(path)
    assert fmt == "philly"
    assert [(r.submit, r.duration, r.gpus, r.group) for r in raw] == [
        (60, 66, 1, "vcA"),
        (0, 100, 2, "vcB"),
        (180, 30, 1, "vcA"),
    ]
    prepared = prepare(
        fmt, raw, parse_cluster_spec("1x4:p100"), None, PrepareOptions(vc="vcA")
    )
    assert [j.submit for j in prepared.jobs] == [0, 120]  # shifted to the VC start
    assert all(j.user.startswith("vcA-u") for j in prepared.jobs)
    assert any("users" in a for a in prepared.assumptions)


def test_gavel_reader_steps_to_duration_and_skips(tmp_path):
    path = write(
        tmp_path,
        "gavel.csv",
        "vc,job_type,num_steps_arg,needs_data_dir,total_steps,arrival_time_s,scale_factor\n"
        'v,"ResNet",-n,1,100,0.0,1\n'
        'v,"ResNet",-n,1,100,10.0,4\n'
        'v,"ResNet",-n,1,100,20.0,8\n'
        'v,"LM",-n,1,100,30.0,2\n'
        'v,"ResNet",-n,1,100,40.0,64\n'
        'w,"ResNet",-n,1,100,40.0,1\n',
    )
    fmt, raw = read_trace(path)
    assert fmt == "gavel"
    table, _ = read_throughputs(write(tmp_path, "thr.csv", THROUGHPUTS))
    prepared = prepare(
        fmt,
        raw,
        parse_cluster_spec("2x4:P100"),
        table,
        PrepareOptions(vc="v", time_scale=0.5),
    )
    # 1 GPU: 100/2; 4 GPUs on one node: 100/4; 8 GPUs span nodes: unconsolidated 100/5
    assert [j.ref_duration for j in prepared.jobs] == [50, 25, 20]
    assert [j.submit for j in prepared.jobs] == [0, 5, 10]
    assert all(j.label == "ResNet" and j.steps == 100 for j in prepared.jobs)
    # LM x2 has throughput 0 (missing); 64 GPUs exceed the cluster
    assert prepared.skipped == {
        "more_gpus_than_cluster": 1,
        "no_throughput_for_gpu_count": 1,
    }


def test_worker_type_matched_case_insensitively(tmp_path):
    table, _ = read_throughputs(write(tmp_path, "thr.csv", THROUGHPUTS))
    path = write(
        tmp_path,
        "t.csv",
        "job_id,submit_time,num_gpus,workload,steps\nx,0,1,ResNet,10\n",
    )
    fmt, raw = read_trace(path)
    prepared = prepare(fmt, raw, parse_cluster_spec("1x8:k80"), table, PrepareOptions())
    assert prepared.jobs[0].ref_duration == pytest.approx(10.0)


def test_user_limits_rule():
    assert user_limit_for(100, 1.5) == 3600
    assert user_limit_for(3000, 1.5) == 7200
    assert user_limit_for(20 * 3600, 1.1) == 24 * 3600
    assert user_limit_for(100 * 3600, 1.5) == 168 * 3600
    assert user_limit_for(200 * 3600, 1.1) == 10 * 86400  # 220 h -> 10 days


def test_limits_seeded_identical_and_fraction(tmp_path):
    rows = "".join(f"j{i},{i},1,{100 + i * 50}\n" for i in range(400))
    path = write(tmp_path, "t.csv", "job_id,submit_time,num_gpus,duration\n" + rows)
    fmt, raw = read_trace(path)
    nodes = parse_cluster_spec("1x4:p100")
    a = prepare(fmt, raw, nodes, None, PrepareOptions(seed=3))
    fmt, raw = read_trace(path)
    b = prepare(fmt, raw, nodes, None, PrepareOptions(seed=3))
    assert [(j.time_limit, j.user) for j in a.jobs] == [
        (j.time_limit, j.user) for j in b.jobs
    ]
    no_limit = sum(1 for j in a.jobs if not j.user_limit)
    assert 150 < no_limit < 250
    assert all(j.time_limit == 86400 for j in a.jobs if not j.user_limit)
    assert all(j.time_limit > j.ref_duration * 1.1 for j in a.jobs if j.user_limit)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("job_id,submit_time\na,0\n", r":1: canonical trace is missing|unknown trace"),
        (
            "job_id,submit_time,num_gpus,duration\na,0,1,10\nb,-5,1,10\n",
            r":3: .*negative",
        ),
        ("job_id,submit_time,num_gpus,duration\na,0,x,10\n", r":2: .*not a number"),
        (
            "job_id,submit_time,num_gpus,duration\na,0,1,10\nb,1,1,ten\n",
            r":3: .*number",
        ),
        ("job_id,submit_time,num_gpus,duration\na,0,1.5,10\n", r":2: .*whole number"),
        ("job_id,submit_time,num_gpus,duration\na,0,1,10,\nb,1,1,\n", r":3: .*neither"),
        (
            "job_id,submit_time,num_gpus,duration,priority\na,0,1,10,vip\n",
            r":2: unknown priority class",
        ),
        ("timestamp,duration,num_gpus,cluster\nnope,1,1,x\n", r":2: .*timestamp"),
    ],
)
def test_bad_traces_name_the_line(tmp_path, capsys, text, expected):
    path = write(tmp_path, "bad.csv", text)
    code = main(["--trace", path, "--cluster", "1x4:p100", "--policy", "fifo"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert "Traceback" not in err
    import re

    assert re.search(expected, err), err


def test_cli_bad_cluster_spec(tmp_path, capsys):
    path = write(tmp_path, "t.csv", "job_id,submit_time,num_gpus,duration\na,0,1,10\n")
    assert main(["--trace", path, "--cluster", "4xfoo", "--policy", "fifo"]) == 2
    assert "error:" in capsys.readouterr().err


def _run_cli(tmp_path: Path, out: str, seed: int) -> dict:
    rows = "".join(
        f"j{i},{i * 13},{1 + i % 3},{60 + (i * 97) % 900},u{i % 4},g{i % 2}\n"
        for i in range(120)
    )
    path = write(
        tmp_path, "t.csv", "job_id,submit_time,num_gpus,duration,user,group\n" + rows
    )
    out_path = tmp_path / out
    code = main(
        [
            "--trace", path, "--cluster", "2x4:p100", "--policy", "fifo",
            "--seed", str(seed), "--out", str(out_path), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    return json.loads(out_path.read_text())


REQUIRED_KEYS = {
    "jobs", "avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "p99_queue_s",
    "makespan_s", "gpu_utilization", "avg_slowdown", "jain_fairness", "jct_by_size",
    "offered_load", "skipped", "preemptions", "passes", "avg_decide_ms",
    "p99_decide_ms", "policy", "cluster", "trace", "options", "seed",
}  # fmt: skip


def test_cli_output_keys_and_determinism(tmp_path):
    a = _run_cli(tmp_path, "a.json", 7)
    b = _run_cli(tmp_path, "b.json", 7)
    assert set(a) >= REQUIRED_KEYS
    assert a["jobs"] == 120 and a["policy"] == "fifo" and a["seed"] == 7
    volatile = {
        "avg_decide_ms",
        "p99_decide_ms",
        "replay_wall_s",
        "read_s",
        "prepare_s",
        "stage_mean_ms",
    }
    strip = lambda d: {k: v for k, v in d.items() if k not in volatile}  # noqa: E731
    assert strip(a) == strip(b)
    c = _run_cli(tmp_path, "c.json", 8)
    assert strip(c) != strip(a)  # the seed draws the limits


def test_module_runs_without_django(tmp_path):
    path = write(tmp_path, "t.csv", "job_id,submit_time,num_gpus,duration\na,0,1,10\n")
    code = (
        "import runpy, sys; sys.argv = ['sim', '--trace', {!r}, '--cluster', '1x1:p100',"
        " '--policy', 'fifo', '--quiet', '--out', {!r}]\n"
        "try:\n    runpy.run_module('scheduler.sim', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'django' not in sys.modules, 'django imported'\n"
    ).format(path, str(tmp_path / "o.json"))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
        check=False, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "o.json").read_text())["jobs"] == 1


@pytest.mark.parametrize("plan", ["limit", "prediction"])
def test_cli_passes_the_backfill_plan_to_the_policy(tmp_path, plan, monkeypatch):
    seen: list[str] = []

    def spy(state):
        seen.append(state.config.backfill_plan)
        return decide(state)

    def simulator(*args, **kwargs):
        kwargs["decide_fn"] = spy
        return Simulator(*args, **kwargs)

    monkeypatch.setattr(sim_cli, "Simulator", simulator)
    path = write(tmp_path, "t.csv", "job_id,submit_time,num_gpus,duration\na,0,1,10\n")
    out = tmp_path / "o.json"
    args = ["--trace", path, "--cluster", "1x1:p100", "--policy", "gpulab"]
    code = main([*args, "--backfill-plan", plan, "--quiet", "--out", str(out)])
    assert code == 0
    assert seen and set(seen) == {plan}
    assert json.loads(out.read_text())["options"]["backfill_plan"] == plan
