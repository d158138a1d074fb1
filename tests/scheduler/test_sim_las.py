"""Preemption by attained service in the simulator: what it costs (the work since
the victim's last checkpoint, a restart overhead) and the trace's columns."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig, run_pass
from scheduler.sim.engine import SimOptions, Simulator
from scheduler.sim.metrics import summarize
from scheduler.sim.prepare import PrepareOptions, prepare
from scheduler.sim.tiresias import TiresiasParams, runner
from scheduler.sim.trace import TraceError, read_trace
from tests.scheduler.test_sim_policies import sim_job

if TYPE_CHECKING:
    from pathlib import Path


def replay(
    policy: str,
    *,
    ckpt: bool,
    interval: float | None = None,
    b_runs: float = 100,
    pass_fn=run_pass,
    **opts,
):
    # 1 GPU. A (10,000 s) at 0; B (``b_runs``, 100 s) arrives at 3,000
    a = sim_job(1, 0, 10_000, ckpt=ckpt)
    a.checkpoint_interval_s = interval
    jobs = [a, sim_job(2, 3000, b_runs)]
    sim = Simulator(
        jobs,
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name=policy, las_threshold_gpu_s=2000.0),
        SimOptions(**opts),
        pass_fn=pass_fn,
    )
    return jobs, summarize(sim.run())


def test_gpulab_preempts_a_checkpointable_job_for_a_new_one_and_charges_the_loss():
    (a, b), out = replay("gpulab", ckpt=True)
    # preempted at 3,000, stopped at 3,030 (grace); B runs 3,030-3,130; A
    # resumes with its 1,800 s checkpoint, pays 60 s, and has 8,200 s left
    assert (b.first_start, b.end) == (3030, 3130)
    assert a.preemptions == 1 and a.resumes == 1
    assert a.end == pytest.approx(3130 + 60 + 8200)
    # lost: 3,030 - 1,800 s of work, plus the 60 s restart
    assert out["preempted_gpu_s_lost"] == pytest.approx(1230.0)
    assert out["preemption_lost_gpu_hours"] == pytest.approx(1290 / 3600)
    busy = 3030 + 100 + 60 + 8200
    assert out["preemption_lost_share"] == pytest.approx(1290 / busy)
    assert out["checkpointable_jobs"] == 1


def test_the_job_s_own_checkpoint_interval_is_used():
    (a, _), out = replay("gpulab", ckpt=True, interval=1000.0)
    # 3 checkpoints: 3,000 s kept of 3,030
    assert a.end == pytest.approx(3130 + 60 + 7000)
    assert out["preempted_gpu_s_lost"] == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("policy", "ckpt"),
    [("gpulab", False), ("slurm", True), ("fifo", True)],
)
def test_no_preemption_by_service_without_checkpoints_or_outside_gpulab(policy, ckpt):
    (a, b), out = replay(policy, ckpt=ckpt)
    assert a.preemptions == 0 and b.first_start == 10_000
    assert out["preemption_lost_gpu_hours"] == 0.0


def test_the_minimum_run_protects_a_fresh_attempt():
    # B arrives 5 min after A's start: A is protected until 600, where its
    # 600 GPU-s are still under the 650 GPU-s threshold; the periodic pass at
    # 660 preempts it (B stays under the threshold through its own 600 s)
    a = sim_job(1, 0, 10_000, ckpt=True)
    jobs = [a, sim_job(2, 300, 100)]
    Simulator(
        jobs,
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name="gpulab", las_threshold_gpu_s=650.0),
    ).run()
    assert a.preempt_times == [660.0]
    assert jobs[1].first_start == 690.0


def test_a_waiting_job_s_view_counts_its_preemptions_of_the_last_hour():
    # A (checkpointable) is preempted at 3,000 for B, which does not checkpoint
    # and runs 5,000 s: A waits 3,030-8,030, its preemption an hour old at 6,600
    seen: list[tuple[float, int]] = []

    def spy(state):
        seen.extend(
            (state.now, j.preemptions_last_hour) for j in state.pending if j.id == 1
        )
        return run_pass(state)

    (a, _), _ = replay("gpulab", ckpt=True, b_runs=5000, pass_fn=spy)
    assert a.preempt_times == [3000.0]
    waiting = [(t, n) for t, n in seen if t > 3000]
    assert {n for t, n in waiting if t < 6600} == {1}
    assert {n for t, n in waiting if t >= 6600} == {0}
    assert max(t for t, _ in waiting) > 6600  # it was seen after the hour too


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "t.csv"
    path.write_text(text)
    return str(path)


def test_the_trace_s_checkpoint_columns(tmp_path):
    path = write(
        tmp_path,
        "job_id,submit_time,num_gpus,duration,checkpointable,checkpoint_interval_s\n"
        "a,0,1,100,1,600\n"
        "b,1,1,100,0,\n"
        "c,2,1,100,,\n",
    )
    fmt, raw = read_trace(path)
    nodes = parse_cluster_spec("1x1:p100")
    # the column wins over the drawn fraction; an empty cell is drawn
    got = prepare(fmt, raw, nodes, None, PrepareOptions(checkpointable_fraction=1.0))
    a, b, c = got.jobs
    assert (a.checkpointable, a.checkpoint_interval_s) == (True, 600.0)
    assert (b.checkpointable, b.checkpoint_interval_s) == (False, None)
    assert c.checkpointable
    none = prepare(fmt, raw, nodes, None, PrepareOptions())
    assert [j.checkpointable for j in none.jobs] == [True, False, False]


@pytest.mark.parametrize(
    ("cells", "match"),
    [
        ("yes,", "'checkpointable' must be 0 or 1"),
        ("1,-5", "'checkpoint_interval_s' is negative"),
        ("1,soon", "'checkpoint_interval_s' is not a number"),
    ],
)
def test_bad_checkpoint_cells_name_the_column_and_line(tmp_path, cells, match):
    path = write(
        tmp_path,
        "job_id,submit_time,num_gpus,duration,checkpointable,checkpoint_interval_s\n"
        f"a,0,1,100,{cells}\n",
    )
    with pytest.raises(TraceError, match=rf"t\.csv:2: column {match}"):
        read_trace(path)


@pytest.mark.parametrize("ckpt", [True, False])
def test_tiresias_preempts_only_jobs_that_checkpoint(ckpt):
    # 1 GPU, threshold 100 GPU-s: B (50 s) arrives at 200 while A is in queue 1
    jobs = [sim_job(1, 0, 1000, ckpt=ckpt), sim_job(2, 200, 50)]
    policy = runner(TiresiasParams(threshold_gpu_s=100.0), {j.id: j for j in jobs})
    Simulator(
        jobs,
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name="tiresias"),
        SimOptions(preempt_checkpointable=True),
        pass_fn=policy.run,
    ).run()
    assert jobs[0].preemptions == (1 if ckpt else 0)
    assert jobs[1].first_start == (230 if ckpt else 1000)
