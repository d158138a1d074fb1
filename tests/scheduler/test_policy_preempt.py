"""Preemption (the reservation stage, gpulab only)."""

from __future__ import annotations

import random

import pytest

from scheduler.policy import Preempt, Reason, Usage, decide
from tests.scheduler.test_policy_support import (
    NOW,
    SLURM,
    cluster,
    node_gpus,
    pending,
    running,
    starts,
    waits,
)

HOUR = 3600.0


def preempts(ds):
    return [d for d in ds if isinstance(d, Preempt)]


def test_it_preempts_a_minimal_set_and_the_job_waits_for_it():
    # node 1: 4 GPUs, all best-effort (1 GPU each); node 2: 2 free + 2 best-effort.
    run = [
        running(10 + i, (100 + i,), cls="best-effort", started_ago=1000 + i)
        for i in range(4)
    ] + [
        running(20, (202,), cls="best-effort", started_ago=50),
        running(21, (203,), cls="best-effort", started_ago=40),
    ]
    gpus = node_gpus(1, 4) + node_gpus(2, 4)
    ds = decide(cluster(gpus, [pending(1, 4, cls="high")], run=run))
    victims = {p.victim_id for p in preempts(ds)}
    # node 2 needs 2 victims, node 1 would need 4: the minimum is {20, 21}
    assert victims == {20, 21}
    assert all(p.for_job_id == 1 for p in preempts(ds))
    [w] = waits(ds).values()
    assert w.reason is Reason.WAITING_FOR_PREEMPTION
    assert "20, 21" in w.message or "21, 20" in w.message


def test_add_back_removes_victims_that_turned_out_unneeded():
    # youngest first: 30 (node 1, 1 GPU) is tried before 31 (node 2, 2 GPUs);
    # node 2 alone suffices, so 30 is added back.
    run = [
        running(30, (100,), cls="best-effort", started_ago=10),
        running(31, (200, 201), cls="best-effort", started_ago=100),
        running(40, (101,), cls="normal"),
    ]
    gpus = node_gpus(1, 2) + node_gpus(2, 2)
    ds = decide(cluster(gpus, [pending(1, 2, cls="normal")], run=run))
    assert [p.victim_id for p in preempts(ds)] == [31]


def test_over_share_groups_are_preempted_first():
    usage = Usage(group_usage={"hog": 900.0, "fair": 100.0})
    run = [
        running(50, (100,), cls="best-effort", group="fair", started_ago=10),
        running(51, (101,), cls="best-effort", group="hog", started_ago=5000),
    ]
    ds = decide(
        cluster(node_gpus(1, 2), [pending(1, 1, cls="high")], run=run, usage=usage)
    )
    assert [p.victim_id for p in preempts(ds)] == [51]


def test_a_non_preemptible_job_is_never_a_victim():
    run = [
        running(60, (100, 101), cls="normal"),
        running(61, (102,), cls="best-effort"),
    ]
    ds = decide(
        cluster(node_gpus(1, 4, busy=(3,)), [pending(1, 3, cls="high")], run=run)
    )
    assert not preempts(ds)
    assert waits(ds)[1].reason is Reason.RESOURCES


@pytest.mark.parametrize(
    ("done", "limit", "expected"), [(1, 2, True), (2, 2, False), (0, 0, False)]
)
def test_the_per_hour_bound_is_respected(done, limit, expected):
    run = [running(70, (100,), cls="best-effort", preemptions=done)]
    ds = decide(
        cluster(
            node_gpus(1, 1),
            [pending(1, cls="high")],
            run=run,
            preempt_max_per_hour=limit,
        )
    )
    assert bool(preempts(ds)) is expected


def test_never_for_a_best_effort_job():
    run = [running(80, (100,), cls="best-effort")]
    ds = decide(
        cluster(node_gpus(1, 1), [pending(1, cls="best-effort", age=HOUR)], run=run)
    )
    assert not preempts(ds)
    assert waits(ds)[1].reason is Reason.RESOURCES


def test_slurm_never_preempts():
    run = [running(80, (100,), cls="best-effort")]
    ds = decide(
        cluster(node_gpus(1, 1), [pending(1, cls="high")], run=run, config=SLURM)
    )
    assert not preempts(ds)


def test_at_most_one_plan_per_pass_and_backfill_keeps_off_its_gpus():
    run = [
        running(90, (100,), cls="best-effort"),
        running(91, (101,), cls="best-effort"),
    ]
    gpus = node_gpus(1, 3) + node_gpus(2, 1)
    jobs = [
        pending(1, 2, cls="high", age=10),  # free 102 + one victim
        pending(2, 2, cls="high"),  # would need the other victim: no second plan
        pending(3, 1, planned=60.0),  # must not take 102 (reserved), takes 200
        pending(4, 1, planned=60.0),  # only 102 is left: held back
    ]
    ds = decide(cluster(gpus, jobs, run=run))
    assert len(preempts(ds)) == 1
    assert {p.for_job_id for p in preempts(ds)} == {1}
    assert waits(ds)[1].reason is Reason.WAITING_FOR_PREEMPTION
    assert waits(ds)[2].reason is Reason.RESOURCES
    assert starts(ds)[3].gpu_ids == (200,)
    assert waits(ds)[4].reason is Reason.RESERVED_FOR_HIGHER
    assert "preempting" in waits(ds)[4].message


def test_a_gang_can_preempt_across_nodes():
    run = [
        running(95, (100, 101), cls="best-effort"),
        running(96, (200, 201), cls="best-effort"),
    ]
    gpus = node_gpus(1, 2) + node_gpus(2, 2)
    ds = decide(cluster(gpus, [pending(1, 3, cls="high")], run=run))
    assert sorted(p.victim_id for p in preempts(ds)) == [95, 96]


def test_the_plan_with_fewest_victims_wins_over_the_candidate_order():
    # node 1's four victims are the youngest (first in the order), yet node 2 needs
    # only two: one plan per node, fewest victims wins.
    run = [
        running(10 + i, (100 + i,), cls="best-effort", started_ago=10 + i)
        for i in range(4)
    ] + [
        running(20, (202,), cls="best-effort", started_ago=5000),
        running(21, (203,), cls="best-effort", started_ago=6000),
    ]
    gpus = node_gpus(1, 4) + node_gpus(2, 4)
    ds = decide(cluster(gpus, [pending(1, 4, cls="high")], run=run))
    assert sorted(p.victim_id for p in preempts(ds)) == [20, 21]


def test_a_preempting_plan_respects_the_model_constraint():
    run = [
        running(10, (100,), cls="best-effort"),
        running(20, (200,), cls="best-effort"),
    ]
    gpus = node_gpus(1, 1, model="NVIDIA K80") + node_gpus(2, 1, model="NVIDIA P100")
    ds = decide(cluster(gpus, [pending(1, 1, cls="high", model="p100")], run=run))
    assert [p.victim_id for p in preempts(ds)] == [20]


@pytest.mark.parametrize("seed", range(30))
def test_random_plans_free_enough_and_only_take_allowed_victims(seed):
    """For random clusters: every victim is preemptible and under the hourly bound,
    the job it is for is not preemptible, and once the victims are gone the job
    starts; dropping any one victim would not be enough (the plan is minimal)."""
    from dataclasses import replace

    from scheduler.policy import GpuView, Start

    rng = random.Random(seed)
    for _ in range(10):
        gpus: tuple[GpuView, ...] = ()
        for n in range(1, rng.randint(2, 4) + 1):
            gpus += node_gpus(n, rng.choice((2, 4, 8)))
        ids = [g.id for g in gpus]
        rng.shuffle(ids)
        run = []
        for jid, g in enumerate(ids[: int(len(ids) * rng.uniform(0.5, 1.0))], 500):
            run.append(
                running(
                    jid,
                    (g,),
                    cls=rng.choice(("best-effort", "best-effort", "normal")),
                    preemptions=rng.choice((0, 0, 1, 2)),
                    started_ago=rng.uniform(10, 10_000),
                )
            )
        job = pending(
            1, rng.choice((1, 2, 4, 6)), cls=rng.choice(("high", "best-effort"))
        )
        state = cluster(gpus, [job], run=run)
        ds = decide(state)
        victims = {p.victim_id for p in preempts(ds)}
        if not victims:
            continue
        assert job.priority_class == "high"
        by_id = {r.id: r for r in run}
        assert all(by_id[v].preemptible for v in victims)
        assert all(by_id[v].preemptions_last_hour < 2 for v in victims)
        assert waits(ds)[1].reason is Reason.WAITING_FOR_PREEMPTION

        def without(gone):
            left = tuple(r for r in run if r.id not in gone)
            busy = {g for r in left for g in r.gpu_ids}
            views = tuple(replace(g, free_slots=0 if g.id in busy else 1) for g in gpus)
            return replace(state, gpus=views, running=left)

        assert isinstance(decide(without(victims))[0], Start)
        if len(victims) > 1:
            for v in victims:
                fewer = decide(replace(without(victims - {v}), config=SLURM))
                assert not isinstance(fewer[0], Start), (seed, v, victims)


def test_victims_in_their_grace_period_are_waited_for_not_replaced():
    """Pass 1 preempts job 10; in pass 2 job 10 is still on its GPU, being stopped
    (and no longer a candidate, as the loaders mark it): no second victim."""
    from dataclasses import replace

    run = [
        running(10, (100,), cls="best-effort", started_ago=10),
        running(11, (101,), cls="best-effort", started_ago=5000),
    ]
    s1 = cluster(node_gpus(1, 2), [pending(1, 1, cls="high")], run=run)
    assert [p.victim_id for p in preempts(decide(s1))] == [10]
    run[0] = replace(run[0], preemptible=False, stopping=True)
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1, cls="high")], run=run))
    assert not preempts(ds)
    w = waits(ds)[1]
    assert w.reason is Reason.WAITING_FOR_PREEMPTION
    assert "waiting for job(s) 10 (already being stopped)" in w.message


def test_a_plan_adds_only_what_the_stopping_jobs_do_not_cover():
    from dataclasses import replace

    run = [
        replace(
            running(10, (100,), cls="best-effort"), preemptible=False, stopping=True
        ),
        running(11, (101,), cls="best-effort", started_ago=10),
        running(12, (102,), cls="best-effort", started_ago=20),
    ]
    ds = decide(cluster(node_gpus(1, 3), [pending(1, 2, cls="high")], run=run))
    assert [p.victim_id for p in preempts(ds)] == [11]
    assert (
        "stopping preemptible job(s) 11 and waiting for job(s) 10"
        in waits(ds)[1].message
    )


def test_without_preemption_a_stopping_job_frees_its_gpus_now_in_the_plan():
    from dataclasses import replace

    run = [replace(running(10, (100,), ends_in=5 * 3600), stopping=True)]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1)], run=run, config=SLURM))
    assert waits(ds)[1].est_start == NOW
