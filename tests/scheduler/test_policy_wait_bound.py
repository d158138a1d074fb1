"""The absolute wait bound (``policy.wait_bound``, ``gpulab`` only): a batch job
that has waited longer than ``max_wait_s`` goes ahead of every job of its class
and below, and is not preempted by attained service."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.policy import PendingJob, Preempt, Usage, decide
from scheduler.policy import stages as st
from scheduler.policy.wait_bound import bound_order, waited_s
from tests.scheduler.test_policy_order import cluster as order_cluster
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
BOUND = 48 * HOUR  # the tests' bound (the default is 96 h)
# the heavy user has used nearly everything: its fair-share factor is near 0
USAGE = Usage(
    group_usage={"heavy": 1e6, "light": 1.0},
    user_usage={("heavy", "h"): 1e6, ("light", "l"): 1.0},
)


def heavy(job_id: int, *, age: float, planned: float = 30 * HOUR, **kw) -> PendingJob:
    return pending(job_id, age=age, planned=planned, group="heavy", user="h", **kw)


def light(job_id: int, *, age: float = 0.0, planned: float = 600.0, **kw) -> PendingJob:
    return pending(job_id, age=age, planned=planned, group="light", user="l", **kw)


def order_of(ds) -> list[int]:
    return [w.job_id for w in sorted(waits(ds).values(), key=lambda w: w.position)]


def test_a_job_over_the_bound_goes_first_whatever_its_fair_share_and_run_time():
    # one free GPU; the heavy user's long job has waited 50 h, the light user's
    # short job just arrived: shortest-first and fair share favour the new one
    jobs = [heavy(1, age=50 * HOUR), light(2)]
    ds = decide(cluster(node_gpus(1, 1), jobs, usage=USAGE, max_wait_s=BOUND))
    assert set(starts(ds)) == {1}
    # under the bound (47 h), or with the bound off, the new short job goes first
    ds = decide(
        cluster(
            node_gpus(1, 1),
            [heavy(1, age=47 * HOUR), light(2)],
            usage=USAGE,
            max_wait_s=BOUND,
        )
    )
    assert set(starts(ds)) == {2}
    ds = decide(cluster(node_gpus(1, 1), jobs, usage=USAGE, max_wait_s=0.0))
    assert set(starts(ds)) == {2}
    # ``slurm`` never applies it: fair share decides there
    ds = decide(
        cluster(node_gpus(1, 1), jobs, usage=USAGE, config=SLURM, max_wait_s=BOUND)
    )
    assert set(starts(ds)) == {2}


def test_the_default_bound_is_four_days():
    # with the default config (no ``max_wait_s`` given) the heavy user's long job
    # passes the new short one once it has waited over 96 h, and not before
    for waited, first in ((97 * HOUR, 1), (95 * HOUR, 2)):
        jobs = [heavy(1, age=waited), light(2)]
        ds = decide(cluster(node_gpus(1, 1), jobs, usage=USAGE))
        assert set(starts(ds)) == {first}


def test_overdue_jobs_go_oldest_first_and_a_younger_one_never_passes():
    # no free GPU: the order is what the waits show. 1 and 3 are over the bound
    # (3 is older but of the heavy user), 2 and 4 are not
    jobs = [
        light(1, age=49 * HOUR, planned=HOUR),
        light(2, age=10 * HOUR),
        heavy(3, age=60 * HOUR),
        light(4, age=HOUR),
    ]
    ds = decide(
        cluster(node_gpus(1, 1, busy=(0,)), jobs, usage=USAGE, max_wait_s=BOUND)
    )
    assert order_of(ds)[:2] == [3, 1]
    assert set(order_of(ds)[2:]) == {2, 4}
    # without the bound the heavy user's job is last
    ds = decide(cluster(node_gpus(1, 1, busy=(0,)), jobs, usage=USAGE, max_wait_s=0.0))
    assert order_of(ds)[-1] == 3


def test_the_bound_keeps_higher_classes_ahead_and_passes_lower_ones():
    # an overdue ``normal`` job passes a new ``normal`` and a new ``best-effort``
    # job, never a new ``high`` one
    jobs = [
        heavy(1, age=50 * HOUR),
        light(2, cls="high"),
        light(3),
        light(4, cls="best-effort"),
    ]
    ds = decide(
        cluster(node_gpus(1, 1, busy=(0,)), jobs, usage=USAGE, max_wait_s=BOUND)
    )
    assert order_of(ds) == [2, 1, 3, 4]
    # an overdue ``best-effort`` job passes only ``best-effort`` work
    jobs = [
        heavy(1, age=50 * HOUR, cls="best-effort"),
        light(3),
        light(4, cls="best-effort"),
    ]
    ds = decide(
        cluster(node_gpus(1, 1, busy=(0,)), jobs, usage=USAGE, max_wait_s=BOUND)
    )
    assert order_of(ds) == [3, 1, 4]


def test_the_wait_is_time_not_running():
    # submitted 60 h ago, 20 h run on its 2 GPUs (40 GPU-h): waited 40 h, not over
    job = replace(heavy(1, age=60 * HOUR, gpus=2), attained_gpu_s=40 * HOUR)
    assert waited_s(NOW, job.submitted_at, job.attained_gpu_s, job.gpus) == 40 * HOUR
    ds = decide(
        cluster(node_gpus(1, 2), [job, light(2)], usage=USAGE, max_wait_s=BOUND)
    )
    assert set(starts(ds)) == {2}
    # 10 h run of 60 h: waited 50 h, over
    job = replace(job, attained_gpu_s=20 * HOUR)
    ds = decide(
        cluster(node_gpus(1, 2), [job, light(2)], usage=USAGE, max_wait_s=BOUND)
    )
    assert set(starts(ds)) == {1}


def test_an_overdue_job_is_not_preempted_by_attained_service():
    # two checkpointable jobs in the lower queue, on one GPU each: 10 has run
    # 110 h of the 160 h since its submission (waited 50 h, slowdown 1.45), 11
    # 100 h of 120 h (waited 20 h). Least attained service would stop 10 first;
    # over the bound it is exempt, so 11 is the victim
    def ckpt(job_id: int, gpu: int, ran: float, submitted_ago: float):
        r = running(job_id, (gpu,), started_ago=ran)
        return replace(r, checkpointable=True, submitted_at=NOW - submitted_ago)

    run = [ckpt(10, 100, 110 * HOUR, 160 * HOUR), ckpt(11, 101, 100 * HOUR, 120 * HOUR)]
    state = cluster(
        node_gpus(1, 2), [light(1)], run=run, las_threshold_gpu_s=HOUR, max_wait_s=BOUND
    )
    assert [d.victim_id for d in decide(state) if isinstance(d, Preempt)] == [11]
    off = replace(state, config=replace(state.config, max_wait_s=0.0))
    assert [d.victim_id for d in decide(off) if isinstance(d, Preempt)] == [10]


def test_bound_order_moves_only_overdue_batch_jobs():
    jobs = [
        pending(1, cls="interactive", age=99 * HOUR),
        pending(2, cls="high"),
        pending(3, age=HOUR),
        pending(4, age=50 * HOUR),
        pending(5, cls="high", age=60 * HOUR),
        pending(6, cls="best-effort"),
    ]
    parts = {"interactive": 2.0, "high": 1.0, "normal": 0.5, "best-effort": 0.0}
    got = bound_order(
        jobs, NOW, 48 * HOUR, lambda j: parts[j.priority_class], {"interactive"}
    )
    # the interactive job stays first; 5 goes before 2, 4 before 3
    assert [j.id for j in got] == [1, 5, 2, 4, 3, 6]
    assert bound_order(jobs, NOW, 0.0, lambda j: 0.0, set()) is jobs
    young = [j for j in jobs if j.id in (2, 3, 6)]
    assert bound_order(young, NOW, 48 * HOUR, lambda j: 0.0, set()) is young


@pytest.mark.parametrize("seed", range(3))
def test_in_a_whole_pass_no_younger_job_of_its_class_or_below_is_ahead_of_an_overdue_one(
    seed,
):
    # 1,500 jobs, some 9 days old, some resumed (``test_policy_order``'s instance)
    state = order_cluster(seed, "gpulab")
    p = st.Pass(state, preemption=True, topology=True, predictions=False, runtime=True)
    order = st.ordering(p)
    cls = {j.id: p.breakdowns[j.id]["class"] for j in order}
    limit = state.config.max_wait_s

    def over(j: PendingJob) -> bool:
        return waited_s(state.now, j.submitted_at, j.attained_gpu_s, j.gpus) > limit

    def passed(order: list[PendingJob]) -> list[tuple[int, int]]:
        """(j, o): j is ahead of the overdue o, of its class or below, and is not
        overdue, or of a lower class, or younger."""
        out = []
        for k, o in enumerate(order):
            if over(o):
                out += [
                    (j.id, o.id)
                    for j in order[:k]
                    if cls[j.id] <= cls[o.id]
                    and not (
                        over(j)
                        and cls[j.id] == cls[o.id]
                        and j.submitted_at <= o.submitted_at
                    )
                ]
        return out

    assert any(over(j) for j in order)
    assert passed(order) == []
    # without the bound the same instance has such pairs
    off = replace(state, config=replace(state.config, max_wait_s=0.0))
    p = st.Pass(off, preemption=True, topology=True, predictions=False, runtime=True)
    assert passed(st.ordering(p))


def test_a_preempted_job_is_overdue_once_it_has_waited_the_bound_since():
    # the heavy user's long job ran 5 h and was preempted; with a 24-h bound after
    # a preemption it passes the new short job once 24 h have gone by since, and
    # not before, though its whole wait (25 h, 23 h) is far under ``max_wait_s``
    def stopped(ago: float) -> PendingJob:
        job = heavy(1, age=30 * HOUR)
        return replace(
            job, attained_gpu_s=5 * HOUR, checkpointable=True, preempted_at=NOW - ago
        )

    for ago, first in ((25 * HOUR, 1), (23 * HOUR, 2)):
        ds = decide(
            cluster(
                node_gpus(1, 1),
                [stopped(ago), light(2)],
                usage=USAGE,
                preempted_max_wait_s=24 * HOUR,
            )
        )
        assert set(starts(ds)) == {first}
    # off (the default): the short job first
    ds = decide(cluster(node_gpus(1, 1), [stopped(25 * HOUR), light(2)], usage=USAGE))
    assert set(starts(ds)) == {2}
    # ``bound_order`` alone, with ``max_wait_s`` off
    jobs = [light(2), stopped(25 * HOUR), light(3)]
    got = bound_order(jobs, NOW, 0.0, lambda j: 0.0, set(), 24 * HOUR)
    assert [j.id for j in got] == [1, 2, 3]


def test_a_job_restarted_that_long_after_its_preemption_is_not_preempted_again():
    # two checkpointable jobs in the lower queue: 10 has the most attained service
    # (the first victim) but restarted 30 h after it was preempted; 11 restarted
    # 1 h after. With a 24-h bound after a preemption, 11 is the victim
    def ckpt(job_id: int, gpu: int, ran: float, gap: float):
        r = running(job_id, (gpu,), started_ago=ran)
        return replace(
            r,
            checkpointable=True,
            submitted_at=NOW - 200 * HOUR,
            preempted_at=r.started_at - gap,
        )

    run = [ckpt(10, 100, 110 * HOUR, 30 * HOUR), ckpt(11, 101, 100 * HOUR, HOUR)]
    state = cluster(
        node_gpus(1, 2),
        [light(1)],
        run=run,
        las_threshold_gpu_s=HOUR,
        max_wait_s=0.0,
        las_max_slowdown=10.0,
        preempted_max_wait_s=24 * HOUR,
    )
    assert [d.victim_id for d in decide(state) if isinstance(d, Preempt)] == [11]
    off = replace(state, config=replace(state.config, preempted_max_wait_s=0.0))
    assert [d.victim_id for d in decide(off) if isinstance(d, Preempt)] == [10]
