"""Preemption by least attained service (``preempt.las_candidates``, gpulab only)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.policy import PendingJob, Preempt, Reason, RunningJob, decide
from tests.scheduler import test_policy_support as support
from tests.scheduler.test_policy_support import (
    NOW,
    SLURM,
    node_gpus,
    pending,
    running,
    starts,
    waits,
)

HOUR = 3600.0


def cluster(*args, **changes):
    """``test_policy_support.cluster`` with the LAS queues split at 1 GPU-h."""
    return support.cluster(*args, **{"las_threshold_gpu_s": HOUR, **changes})


def ckpt(
    job_id: int,
    gpu_ids: tuple[int, ...],
    *,
    ran: float = 2 * HOUR,
    prior_gpu_s: float = 0.0,
    cls: str = "normal",
    preemptions: int = 0,
) -> RunningJob:
    """A checkpointable running job that started ``ran`` seconds ago."""
    return replace(
        running(job_id, gpu_ids, cls=cls, started_ago=ran, preemptions=preemptions),
        checkpointable=True,
        prior_gpu_s=prior_gpu_s,
    )


def preempts(ds):
    return [d for d in ds if isinstance(d, Preempt)]


def test_a_new_job_preempts_the_most_attained_checkpointable_job():
    # 2 GPUs, both busy: 10 has run 2 h, 11 has run 5 h (1 GPU each)
    run = [ckpt(10, (100,), ran=2 * HOUR), ckpt(11, (101,), ran=5 * HOUR)]
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1)], run=run))
    [p] = preempts(ds)
    assert (p.victim_id, p.for_job_id) == (11, 1)
    assert "least attained service" in p.reason
    assert "5.0 GPU-h attained" in p.reason
    w = waits(ds)[1]
    assert w.reason is Reason.WAITING_FOR_PREEMPTION
    assert "stopping checkpointable job(s) 11" in w.message
    assert not starts(ds)


def test_earlier_attempts_count_in_the_attained_service():
    # 10 ran 1 h now but 6 GPU-h before: it is the most attained
    run = [
        ckpt(10, (100,), ran=HOUR, prior_gpu_s=6 * HOUR),
        ckpt(11, (101,), ran=3 * HOUR),
    ]
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1)], run=run))
    assert [p.victim_id for p in preempts(ds)] == [10]


def test_a_job_that_does_not_checkpoint_is_never_a_victim():
    run = [running(10, (100,), started_ago=10 * HOUR), ckpt(11, (101,), ran=HOUR)]
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1)], run=run))
    assert [p.victim_id for p in preempts(ds)] == [11]
    run = [running(10, (100,), started_ago=10 * HOUR)]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1)], run=run))
    assert not preempts(ds)
    assert waits(ds)[1].reason is Reason.RESOURCES


def test_none_is_preempted_sooner_than_the_minimum_run_after_its_start():
    # 5 min into its attempt (6 GPU-h attained before): protected by the 10 min
    run = [ckpt(10, (100,), ran=300.0, prior_gpu_s=6 * HOUR)]
    state = cluster(node_gpus(1, 1), [pending(1, 1)], run=run)
    assert state.config.preempt_min_run_s == 600.0
    assert not preempts(decide(state))
    shorter = cluster(
        node_gpus(1, 1), [pending(1, 1)], run=run, preempt_min_run_s=240.0
    )
    assert [p.victim_id for p in preempts(decide(shorter))] == [10]


def test_a_job_that_would_leave_the_top_queue_in_its_protected_run_preempts_none():
    # 2,900 GPU-s + 600 s of protected run stays under the 1 GPU-h threshold;
    # 3,000 + 600 reaches it: the job would be a lower-queue job when its
    # protection ends, no better than its victim
    run = [ckpt(10, (100,), ran=75 * 60.0)]
    job = replace(pending(1, 1), attained_gpu_s=3000.0)
    ds = decide(cluster(node_gpus(1, 1), [job], run=run))
    assert not preempts(ds)
    assert waits(ds)[1].reason is Reason.RESOURCES
    job = replace(job, attained_gpu_s=2900.0)
    ds = decide(cluster(node_gpus(1, 1), [job], run=run))
    assert [p.victim_id for p in preempts(ds)] == [10]


def test_only_lower_queue_jobs_are_victims():
    # 59 min of service is under the threshold: not a victim; 60 min is
    run = [ckpt(10, (100,), ran=59 * 60.0)]
    assert not preempts(decide(cluster(node_gpus(1, 1), [pending(1, 1)], run=run)))
    run = [ckpt(10, (100,), ran=60 * 60.0)]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1)], run=run))
    assert [p.victim_id for p in preempts(ds)] == [10]


def test_the_protected_run_scales_with_the_waiting_jobs_gpus():
    # a 4-GPU job runs 4 x 600 s = 2,400 GPU-s protected: with 1,000 before it
    # stays in the top queue (3,400), with 1,300 it does not (3,700)
    gpus = node_gpus(1, 4)
    run = [ckpt(10 + i, (100 + i,), ran=61 * 60.0) for i in range(4)]
    job = replace(pending(1, 4), attained_gpu_s=1000.0)
    ds = decide(cluster(gpus, [job], run=run))
    assert sorted(p.victim_id for p in preempts(ds)) == [10, 11, 12, 13]
    job = replace(job, attained_gpu_s=1300.0)
    assert not preempts(decide(cluster(gpus, [job], run=run)))


def test_the_hourly_bound_holds():
    run = [ckpt(10, (100,), ran=5 * HOUR, preemptions=2)]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1)], run=run))
    assert not preempts(ds)
    ds = decide(
        cluster(node_gpus(1, 1), [pending(1, 1)], run=run, preempt_max_per_hour=3)
    )
    assert [p.victim_id for p in preempts(ds)] == [10]


def test_a_job_of_a_higher_class_is_not_preempted_for_a_lower_one():
    run = [ckpt(10, (100,), ran=5 * HOUR, cls="high")]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1, cls="normal")], run=run))
    assert not preempts(ds)
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1, cls="high")], run=run))
    assert [p.victim_id for p in preempts(ds)] == [10]


def test_a_best_effort_job_preempts_nothing():
    run = [ckpt(10, (100,), ran=5 * HOUR, cls="best-effort")]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1, cls="best-effort")], run=run))
    assert not preempts(ds)


def test_class_victims_come_before_attained_service():
    # a best-effort job (class preemption) is taken before a checkpointable one
    run = [
        running(10, (100,), cls="best-effort", started_ago=60.0),
        ckpt(11, (101,), ran=9 * HOUR),
    ]
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1)], run=run))
    assert [p.victim_id for p in preempts(ds)] == [10]
    assert "class 'best-effort'" in preempts(ds)[0].reason


def test_fewest_victims_on_one_node():
    # node 1: two 1-GPU victims needed; node 2: one 2-GPU victim suffices
    run = [
        ckpt(10, (100,), ran=9 * HOUR),
        ckpt(11, (101,), ran=8 * HOUR),
        ckpt(20, (200, 201), ran=3 * HOUR),
    ]
    gpus = node_gpus(1, 2) + node_gpus(2, 2)
    ds = decide(cluster(gpus, [pending(1, 2)], run=run))
    assert [p.victim_id for p in preempts(ds)] == [20]


def test_a_job_being_stopped_is_waited_for_not_preempted_again():
    stopping = replace(ckpt(10, (100,), ran=5 * HOUR), stopping=True)
    run = [stopping, ckpt(11, (101,), ran=5 * HOUR)]
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1)], run=run))
    assert not preempts(ds)
    w = waits(ds)[1]
    assert w.reason is Reason.WAITING_FOR_PREEMPTION
    assert "waiting for job(s) 10" in w.message


@pytest.mark.parametrize(
    "changes",
    [{"config": SLURM}, {"las_preemption": False}],
    ids=["slurm", "off"],
)
def test_slurm_and_the_switch_off_never_preempt_by_service(changes):
    run = [ckpt(10, (100,), ran=9 * HOUR)]
    ds = decide(cluster(node_gpus(1, 1), [pending(1, 1)], run=run, **changes))
    assert not preempts(ds)
    assert waits(ds)[1].reason is Reason.RESOURCES


def test_gangs_preempt_across_nodes():
    # 4 nodes x 2 GPUs, all checkpointable 2-GPU jobs; an 8-GPU gang needs them
    # all (its protected run is 8 x 600 s: the queues split at 2 GPU-h here)
    gpus = sum((node_gpus(n, 2) for n in (1, 2, 3, 4)), ())
    run = [ckpt(10 + n, (n * 100, n * 100 + 1), ran=4 * HOUR) for n in (1, 2, 3, 4)]
    ds = decide(cluster(gpus, [pending(1, 8)], run=run, las_threshold_gpu_s=2 * HOUR))
    assert sorted(p.victim_id for p in preempts(ds)) == [11, 12, 13, 14]


def resumed(
    job_id: int, attained: float, *, preempted_at: float = NOW, **kw
) -> PendingJob:
    """A checkpointable job back in the queue after a preemption."""
    return replace(
        pending(job_id, **kw),
        checkpointable=True,
        attained_gpu_s=attained,
        preempted_at=preempted_at,
    )


def order_of(ds) -> list[int]:
    return [w.job_id for w in sorted(waits(ds).values(), key=lambda w: w.position)]


def test_a_preempted_job_waits_behind_the_job_it_was_stopped_for():
    # the victim (5 GPU-h, submitted long ago) would rank first by age; it
    # goes behind the fresh job it was preempted for, which takes the GPU
    victim = resumed(10, 5 * HOUR, age=10 * HOUR)
    ds = decide(cluster(node_gpus(1, 1), [victim, pending(1, 1)]))
    assert list(starts(ds)) == [1]
    assert order_of(ds) == [10]
    # without the rule it would have started first
    ds = decide(cluster(node_gpus(1, 1), [victim, pending(1, 1)], las_preemption=False))
    assert list(starts(ds)) == [10]


def test_lower_queue_work_waits_behind_top_queue_work_only():
    # 10 has 2 GPU-h (lower queue), 11 has 30 min (top queue: 40 min with its
    # protected run), 12 and 13 are fresh: by age 10, 11, 12, 13; 10 goes last
    jobs = [
        resumed(10, 2 * HOUR, age=300.0),
        resumed(11, 0.5 * HOUR, age=200.0),
        pending(12, 1, age=100.0),
        pending(13, 1, age=50.0),
    ]
    ds = decide(cluster(node_gpus(1, 1, busy=(0,)), jobs))
    assert order_of(ds) == [11, 12, 13, 10]
    # with a 2 h minimum run none of them stays in the top queue: nothing moves
    ds = decide(cluster(node_gpus(1, 1, busy=(0,)), jobs, preempt_min_run_s=7200.0))
    assert order_of(ds) == [10, 11, 12, 13]


def test_the_order_rule_keeps_classes():
    # a high resumed job stays ahead of a normal fresh one
    jobs = [resumed(10, 5 * HOUR, cls="high", age=60.0), pending(11, 1, age=30.0)]
    ds = decide(cluster(node_gpus(1, 1, busy=(0,)), jobs))
    assert order_of(ds) == [10, 11]


def test_a_preempted_job_yields_only_to_jobs_that_waited_when_it_was_stopped():
    # 10 was preempted 10 min ago: 11 (waiting for 20 min) passes it, 12
    # (submitted 5 min ago) does not
    jobs = [
        resumed(10, 5 * HOUR, age=3 * HOUR, preempted_at=NOW - 600.0),
        pending(11, 1, age=1200.0),
        pending(12, 1, age=300.0),
    ]
    ds = decide(cluster(node_gpus(1, 1, busy=(0,)), jobs))
    assert order_of(ds) == [11, 10, 12]


def test_only_preempted_checkpointable_work_moves():
    # the same service without a preemption, or without checkpoints: no move
    for job in (
        replace(resumed(10, 5 * HOUR, age=HOUR), preempted_at=None),
        replace(resumed(10, 5 * HOUR, age=HOUR), checkpointable=False),
    ):
        ds = decide(cluster(node_gpus(1, 1, busy=(0,)), [job, pending(11, 1)]))
        assert order_of(ds) == [10, 11]


def test_the_wait_bound_exempts_a_job_that_has_waited_as_long_as_it_ran():
    # 10 ran 5 h of its 8 h in the system (slowdown 1.6): a victim; 11 ran
    # 5 h of 11 h (2.2, over the bound of 2): not
    run = [
        replace(ckpt(10, (100,), ran=5 * HOUR), submitted_at=NOW - 8 * HOUR),
        replace(ckpt(11, (101,), ran=5 * HOUR), submitted_at=NOW - 11 * HOUR),
    ]
    ds = decide(cluster(node_gpus(1, 2), [pending(1, 1), pending(2, 1)], run=run))
    assert [p.victim_id for p in preempts(ds)] == [10]
    # the same in the order: a preempted job past the bound is not held back
    late = resumed(10, 5 * HOUR, age=11 * HOUR)
    ds = decide(cluster(node_gpus(1, 1, busy=(0,)), [late, pending(11, 1)]))
    assert order_of(ds) == [10, 11]
    ds = decide(
        cluster(
            node_gpus(1, 1, busy=(0,)), [late, pending(11, 1)], las_max_slowdown=3.0
        )
    )
    assert order_of(ds) == [11, 10]
