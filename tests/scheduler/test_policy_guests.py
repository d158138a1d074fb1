"""Guests (``PolicyConfig.guest_backfill``): a checkpointable job backfilled onto
the GPUs the top blocked job's reservation holds, past its shadow time, and
preempted for that job once it could start but for guests
(``stages.backfill_one``, ``stages.reserve_top``, ``preempt.guests``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agents.spec import parse_cluster_spec
from scheduler.policy import PolicyConfig, Preempt, Reason, decide
from scheduler.sim.engine import Simulator
from scheduler.sim.metrics import summarize
from tests.scheduler.test_policy_las import HOUR
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
from tests.scheduler.test_sim_policies import sim_job


def preempts(ds):
    return [d for d in ds if isinstance(d, Preempt)]


def ckpt_job(job_id, gpus=1, *, planned=3 * HOUR, limit=None, **kw):
    return replace(
        pending(job_id, gpus, planned=planned, limit=limit, **kw), checkpointable=True
    )


def guest(job_id, gpu_ids, *, ran, ends_in=3 * HOUR):
    return replace(
        running(job_id, gpu_ids, started_ago=ran, ends_in=ends_in),
        checkpointable=True,
        guest=True,
    )


def reserved(mode="on", *, second=None, top_cls="normal", ends_in=2 * HOUR, **cfg):
    """One node of 4 GPUs: job 10 holds 100-101 for ``ends_in``; job 1 (4 GPUs)
    is the top blocked job, reserved all four at its end; ``second`` waits
    behind it (default: a checkpointable 1-GPU job of 3 h)."""
    run = [running(10, (100, 101), ends_in=ends_in)]
    jobs = [
        pending(1, 4, age=600.0, cls=top_cls),
        second if second is not None else ckpt_job(2),
    ]
    return cluster(
        node_gpus(1, 4), jobs, run=run, guest_backfill=mode, las_preemption=False, **cfg
    )


def test_off_a_job_past_the_shadow_time_waits():
    w = waits(decide(reserved("off")))
    assert w[2].reason is Reason.RESERVED_FOR_HIGHER
    assert w[1].reason is Reason.RESOURCES


def test_a_checkpointable_job_starts_as_a_guest_on_the_reserved_gpus():
    ds = decide(reserved())
    s = starts(ds)[2]
    assert s.guest and s.backfilled
    assert set(s.gpu_ids) <= {102, 103}
    assert waits(ds)[1].reason is Reason.RESOURCES
    assert not preempts(ds)


def test_a_job_that_fits_the_shadow_time_is_no_guest():
    s = starts(decide(reserved(second=ckpt_job(2, planned=HOUR))))[2]
    assert not s.guest


@pytest.mark.parametrize(
    "second",
    [
        pending(2, 1, planned=3 * HOUR),  # does not checkpoint
    ],
)
def test_only_checkpointable_jobs_are_guests(second):
    assert 2 not in starts(decide(reserved(second=second)))


def test_no_guest_for_a_preemptible_top_job_nor_under_slurm():
    # both best-effort, so that job 1 stays first in line
    be = ckpt_job(2, cls="best-effort")
    assert waits(decide(reserved("off", second=be, top_cls="best-effort")))[2]
    assert 2 not in starts(decide(reserved(second=be, top_cls="best-effort")))
    assert 2 not in starts(decide(reserved(config=SLURM)))


def test_no_guest_when_the_shadow_time_is_under_a_minimum_run_away():
    # job 10 ends in 5 min: a guest would be stopped before its 10-min minimum
    assert 2 not in starts(decide(reserved(ends_in=300.0)))
    assert starts(decide(reserved(ends_in=700.0)))[2].guest


def test_predicted_needs_the_prediction_to_end_by_the_shadow_time():
    # 1 h predicted, 3 h limit: plans by limits keep it out, unless a guest
    short = ckpt_job(2, planned=HOUR, limit=3 * HOUR)
    assert 2 not in starts(decide(reserved("off", second=short)))
    assert starts(decide(reserved("predicted", second=short)))[2].guest
    assert 2 not in starts(decide(reserved("predicted")))  # 3 h predicted
    assert starts(decide(reserved("on")))[2].guest


def due(guests, mode="on", **cfg):
    """Job 10 has ended: job 1 (4 GPUs) could start but for ``guests``."""
    return cluster(
        node_gpus(1, 4),
        [pending(1, 4, age=600.0)],
        run=guests,
        guest_backfill=mode,
        las_preemption=False,
        **cfg,
    )


def test_a_guest_is_preempted_when_the_top_job_is_due():
    ds = decide(due([guest(20, (102,), ran=HOUR)]))
    [p] = preempts(ds)
    assert (p.victim_id, p.for_job_id) == (20, 1)
    assert "guest" in p.reason
    w = waits(ds)[1]
    assert w.reason is Reason.WAITING_FOR_PREEMPTION
    assert "stopping checkpointable job(s) 20" in w.message


def test_guests_are_no_victims_when_off_or_for_other_jobs():
    # guests off: the same running guest is left alone
    assert not preempts(decide(due([guest(20, (102,), ran=HOUR)], "off")))
    # a checkpointable job that is not a guest is no guest victim
    plain = replace(guest(20, (102,), ran=HOUR), guest=False)
    assert not preempts(decide(due([plain])))


def test_a_guest_runs_its_minimum_run_and_the_top_job_is_planned_after_it():
    ds = decide(due([guest(20, (102,), ran=300.0)]))
    assert not preempts(ds)
    w = waits(ds)[1]
    assert w.reason is Reason.RESOURCES
    # planned at the guest's minimum run, not at its 3-h planned end
    assert w.est_start == pytest.approx(NOW + 300.0)


def test_only_the_guests_the_plan_needs_are_stopped():
    # the top job needs 3 GPUs; two guests on 102 and 103: the latest started goes
    g = [guest(20, (102,), ran=2 * HOUR), guest(21, (103,), ran=HOUR)]
    ds = cluster(
        node_gpus(1, 4),
        [pending(1, 3, age=600.0)],
        run=g,
        guest_backfill="on",
        las_preemption=False,
    )
    assert [p.victim_id for p in preempts(decide(ds))] == [21]


def guest_replay(mode: str):
    # 2 GPUs. A (1 GPU, 5,000 s, not checkpointable) at 0; W (2 GPUs, 1,000 s) at
    # 10, reserved both GPUs at A's end; G (1 GPU, 20,000 s, checkpointable) at
    # 20, past that reservation
    a = sim_job(1, 0, 5000, limit=5000)
    w = sim_job(2, 10, 1000, gpus=2, limit=1000)
    g = sim_job(3, 20, 20_000, ckpt=True, limit=20_000)
    jobs = [a, w, g]
    out = Simulator(
        jobs,
        parse_cluster_spec("1x2:p100"),
        PolicyConfig(name="gpulab", guest_backfill=mode),
    ).run()
    return jobs, summarize(out)


def test_in_the_simulator_a_guest_runs_until_the_reserved_job_is_due():
    (a, w, g), _ = guest_replay("off")
    assert g.first_start >= w.end and w.first_start == a.end == 5000
    (a, w, g), out = guest_replay("on")
    assert g.first_start == 20 and g.preemptions == 1 and g.resumes == 1
    # preempted at 5,000, stopped after its 30-s grace, when W starts; G resumes
    # at W's end with its two half-hour checkpoints kept, after a 60-s restart
    assert (w.first_start, w.end) == (5030, 6030)
    assert g.end == pytest.approx(6030 + 60 + 20_000 - 3600)
    # lost: 5,030 - 20 - 3,600 s of work, and the restart
    assert out["preemption_lost_gpu_hours"] == pytest.approx((1410 + 60) / 3600)


def test_planned_by_its_prediction_a_job_is_a_guest_when_its_limit_runs_past():
    # backfill plans with predictions: 1 h predicted ends by the 2-h shadow time,
    # but its 3-h limit does not; on the reserved GPUs it starts as a guest
    short = ckpt_job(2, planned=HOUR, limit=3 * HOUR)
    s = starts(decide(reserved(second=short, backfill_plan="prediction")))[2]
    assert s.guest and s.backfilled
    # guests off, or a limit that ends by the shadow time: a plain start
    s = starts(decide(reserved("off", second=short, backfill_plan="prediction")))[2]
    assert not s.guest
    fits = ckpt_job(2, planned=HOUR, limit=90 * 60.0)
    assert not starts(decide(reserved(second=fits, backfill_plan="prediction")))[
        2
    ].guest
    # not checkpointable: a plain start, as before
    plain = pending(2, 1, planned=HOUR, limit=3 * HOUR)
    s = starts(decide(reserved(second=plain, backfill_plan="prediction")))[2]
    assert not s.guest


def test_a_start_off_the_reserved_gpus_is_no_guest():
    # 5 GPUs: job 1 (4) is reserved 100-103; job 2 fits on 104 outside it
    run = [running(10, (100, 101), ends_in=2 * HOUR)]
    jobs = [pending(1, 4, age=600.0), ckpt_job(2)]
    state = cluster(node_gpus(1, 5), jobs, run=run, guest_backfill="on")
    s = starts(decide(state))[2]
    assert not s.guest and s.gpu_ids == (104,)


def test_a_guest_over_the_hourly_bound_runs_on_and_is_planned_around():
    tired = replace(guest(20, (102,), ran=HOUR, ends_in=HOUR), preemptions_last_hour=2)
    ds = decide(due([tired]))
    assert not preempts(ds)
    w = waits(ds)[1]
    assert w.reason is Reason.RESOURCES
    assert w.est_start == pytest.approx(NOW + HOUR)  # its planned end
    # under the bound (2 an hour by default) it yields
    once = replace(tired, preemptions_last_hour=1)
    assert [p.victim_id for p in preempts(decide(due([once])))] == [20]


def test_a_job_preempted_up_to_the_hourly_bound_is_no_guest():
    # it could not be stopped again within the bound (2 an hour by default)
    twice = replace(ckpt_job(2), preempted_at=NOW - 1800.0, preemptions_last_hour=2)
    assert 2 not in starts(decide(reserved(second=twice)))
    # once in the hour: room for one more stop
    once = replace(twice, preemptions_last_hour=1)
    assert starts(decide(reserved(second=once)))[2].guest
    assert 2 not in starts(decide(reserved(second=once, preempt_max_per_hour=1)))
    # no preemption allowed at all: no guest
    assert 2 not in starts(decide(reserved(preempt_max_per_hour=0)))
