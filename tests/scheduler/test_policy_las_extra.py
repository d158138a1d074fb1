"""Preemption by attained service beyond the top blocked job
(``stages.las_extra``, ``PolicyConfig.las_extra_plans``), the victims' order by
the work they would lose (``las_victims`` "checkpoint"), and the simulator's
true-run-time oracle (``SimOptions.oracle_runtime``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig, Preempt, Reason, decide
from scheduler.policy.remaining import Progress
from scheduler.sim.engine import SimOptions, Simulator
from tests.scheduler.test_policy_las import HOUR, ckpt, cluster
from tests.scheduler.test_policy_support import (
    NOW,
    node_gpus,
    pending,
    running,
    starts,
    waits,
)
from tests.scheduler.test_sim_policies import sim_job


def preempts(ds):
    return [d for d in ds if isinstance(d, Preempt)]


def two_waiting(**changes):
    """One node of 2 GPUs, each held by a checkpointable lower-queue job; two new
    1-GPU jobs wait."""
    run = [ckpt(10, (100,), ran=2 * HOUR), ckpt(11, (101,), ran=3 * HOUR)]
    return cluster(
        node_gpus(1, 2), [pending(1, 1, age=60.0), pending(2, 1)], run=run, **changes
    )


def test_only_the_top_blocked_job_preempts_by_default():
    ds = decide(two_waiting())
    assert [(p.victim_id, p.for_job_id) for p in preempts(ds)] == [(11, 1)]
    assert waits(ds)[2].reason is not Reason.WAITING_FOR_PREEMPTION


def test_a_later_top_queue_job_gets_a_plan_of_its_own():
    ds = decide(two_waiting(las_extra_plans=1))
    assert [(p.victim_id, p.for_job_id) for p in preempts(ds)] == [(11, 1), (10, 2)]
    w = waits(ds)
    assert w[1].reason is Reason.WAITING_FOR_PREEMPTION
    assert w[2].reason is Reason.WAITING_FOR_PREEMPTION
    assert "stopping checkpointable job(s) 10" in w[2].message
    assert not starts(ds)


def test_extra_plans_are_bounded_per_pass():
    run = [ckpt(10 + i, (100 + i,), ran=(2 + i) * HOUR) for i in range(3)]
    jobs = [pending(1 + i, 1, age=60.0 * (3 - i)) for i in range(3)]
    for extra, want in ((1, 2), (2, 3), (5, 3)):
        state = cluster(node_gpus(1, 3), jobs, run=run, las_extra_plans=extra)
        got = preempts(decide(state))
        assert len(got) == want
        assert len({p.victim_id for p in got}) == want  # never one victim twice


def test_an_extra_plan_never_takes_an_earlier_plans_victim_or_gpus():
    # one victim for two waiting jobs: the second gets no plan
    run = [ckpt(10, (100,), ran=2 * HOUR), running(11, (101,), started_ago=HOUR)]
    jobs = [pending(1, 1, age=60.0), pending(2, 1)]
    ds = decide(cluster(node_gpus(1, 2), jobs, run=run, las_extra_plans=3))
    assert [(p.victim_id, p.for_job_id) for p in preempts(ds)] == [(10, 1)]
    assert waits(ds)[2].reason is not Reason.WAITING_FOR_PREEMPTION


def test_an_extra_plans_free_gpu_is_not_backfilled():
    # node 1: GPU 100 free, 101 held by lower-queue victim 11; node 2 held by 12
    # (no checkpoints) for 10 more min. The top job (2 GPUs, lower queue: no
    # plan) is reserved node 2. Job 2 (2 GPUs) gets a plan: victim 11 and the
    # free GPU 100, which job 3 (1 GPU, 1 h) would otherwise be backfilled on.
    run = [
        ckpt(11, (101,), ran=3 * HOUR),
        running(12, (200, 201), started_ago=600.0, ends_in=600.0),
    ]
    jobs = [
        replace(pending(1, 2, age=120.0), attained_gpu_s=2 * HOUR),
        pending(2, 2, age=60.0),
        pending(3, 1),
    ]
    gpus = node_gpus(1, 2) + node_gpus(2, 2)
    base = decide(cluster(gpus, jobs, run=run))
    assert not preempts(base) and 3 in starts(base)
    ds = decide(cluster(gpus, jobs, run=run, las_extra_plans=1))
    assert [(p.victim_id, p.for_job_id) for p in preempts(ds)] == [(11, 2)]
    assert waits(ds)[1].reason is Reason.RESOURCES
    assert waits(ds)[2].reason is Reason.WAITING_FOR_PREEMPTION
    assert 3 not in starts(ds)


def test_victims_by_the_work_they_would_lose():
    # 10: the most attained, its last checkpoint 50 min ago; 11: less attained,
    # checkpointed a minute ago: "attained" stops 10, "checkpoint" stops 11
    run = [
        replace(ckpt(10, (100,), ran=5 * HOUR), checkpoint_at=NOW - 3000.0),
        replace(ckpt(11, (101,), ran=2 * HOUR), checkpoint_at=NOW - 60.0),
    ]
    state = cluster(node_gpus(1, 2), [pending(1, 1)], run=run)
    assert [p.victim_id for p in preempts(decide(state))] == [10]
    by_loss = cluster(
        node_gpus(1, 2), [pending(1, 1)], run=run, las_victims="checkpoint"
    )
    assert [p.victim_id for p in preempts(decide(by_loss))] == [11]
    # without a checkpoint this attempt, the loss counts from its start
    run = [run[0], replace(run[1], checkpoint_at=None)]
    by_loss = cluster(
        node_gpus(1, 2), [pending(1, 1)], run=run, las_victims="checkpoint"
    )
    assert [p.victim_id for p in preempts(decide(by_loss))] == [10]


def _oracle_replay(*, oracle: bool):
    # 1 GPU. A (5,000 s, limit 20,000) at 0; at 100, B (4,000 s) and C (500 s)
    # arrive, both with limit 20,000 and no history: the run-time factor sees
    # equal plans (their limits) unless told the truth
    jobs = [
        sim_job(1, 0, 5000),
        sim_job(2, 100, 4000),
        sim_job(3, 100, 500),
    ]
    for j in jobs:
        j.time_limit = 20_000.0
    Simulator(
        jobs,
        parse_cluster_spec("1x1:p100"),
        PolicyConfig(name="gpulab", backfill_plan="prediction"),
        SimOptions(oracle_runtime=oracle),
    ).run()
    return jobs


def test_the_oracle_tells_the_policy_the_true_run_times():
    _, b, c = _oracle_replay(oracle=False)
    assert b.first_start == 5000 and c.first_start == 9000  # submit order
    _, b, c = _oracle_replay(oracle=True)
    assert c.first_start == 5000 and b.first_start == 5500  # shortest first
    assert c.planned_s == pytest.approx(500.0)


def left(r, seconds):
    """``r`` with its plan ending ``seconds`` from now."""
    return replace(r, planned_s=NOW - r.started_at + seconds)


def test_victims_by_the_time_they_have_left():
    # 10: the most attained (5 h run), ends in 10 min; 11: 2 h run, 3 h left.
    # "attained" stops 10, which would have freed its GPU soon anyway;
    # "remaining" stops 11
    run = [
        left(ckpt(10, (100,), ran=5 * HOUR), 600.0),
        left(ckpt(11, (101,), ran=2 * HOUR), 3 * HOUR),
    ]
    state = cluster(node_gpus(1, 2), [pending(1, 1)], run=run)
    assert [p.victim_id for p in preempts(decide(state))] == [10]
    by_left = cluster(
        node_gpus(1, 2), [pending(1, 1)], run=run, las_victims="remaining"
    )
    assert [p.victim_id for p in preempts(decide(by_left))] == [11]


def test_time_left_from_progress_over_the_plan():
    # 10's plan says 3 h left, its progress says 5 min: it is not the victim
    run = [
        replace(
            left(ckpt(10, (100,), ran=5 * HOUR), 3 * HOUR),
            progress=Progress(step=95.0, total=100.0, at=NOW, rate=1 / 60.0),
        ),
        left(ckpt(11, (101,), ran=2 * HOUR), HOUR),
    ]
    state = cluster(node_gpus(1, 2), [pending(1, 1)], run=run, las_victims="remaining")
    assert [p.victim_id for p in preempts(decide(state))] == [11]


def test_no_victim_that_ends_before_the_waiting_job_would():
    # job 1 is planned 1 h: 10 (20 min left) is no victim under ``las_shorter``,
    # 11 (2 h left) is
    run = [
        left(ckpt(10, (100,), ran=5 * HOUR), 1200.0),
        left(ckpt(11, (101,), ran=2 * HOUR), 2 * HOUR),
    ]
    job = pending(1, 1, planned=HOUR)
    assert [
        p.victim_id for p in preempts(decide(cluster(node_gpus(1, 2), [job], run=run)))
    ] == [10]
    state = cluster(node_gpus(1, 2), [job], run=run, las_shorter=True)
    assert [p.victim_id for p in preempts(decide(state))] == [11]
    # a job planned longer than any victim has left preempts nothing: it waits
    long = pending(1, 1, planned=3 * HOUR)
    ds = decide(cluster(node_gpus(1, 2), [long], run=run, las_shorter=True))
    assert not preempts(ds)
    assert waits(ds)[1].reason is not Reason.WAITING_FOR_PREEMPTION


def test_extra_plans_test_each_jobs_own_plan_against_the_victims():
    # the top job (3 h) finds no victim that ends after it would; job 2 (30 min)
    # does (11, 2 h left), though both are of the same class
    run = [
        left(ckpt(10, (100,), ran=5 * HOUR), 1200.0),
        left(ckpt(11, (101,), ran=2 * HOUR), 2 * HOUR),
    ]
    jobs = [pending(1, 1, age=HOUR, planned=3 * HOUR), pending(2, 1, planned=1800.0)]
    state = cluster(node_gpus(1, 2), jobs, run=run, las_shorter=True, las_extra_plans=1)
    ds = decide(state)
    assert [(p.victim_id, p.for_job_id) for p in preempts(ds)] == [(11, 2)]
