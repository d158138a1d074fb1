"""What ``gpulab`` knows that ``slurm`` does not: predicted run times.

- ``slurm`` plans backfill with time limits, as Slurm does; so does ``gpulab`` by
  default, and with min(limit, prediction) when ``backfill_plan`` is "prediction"
  (a running job that outlived its prediction is then planned to its limit);
- ``gpulab`` ranks shorter planned jobs higher (the ``runtime`` factor), bounded by
  age so a long job is not starved;
- the prediction rule (``policy.predict``) shared by the pass and the simulator.
"""

from __future__ import annotations

import pytest

from scheduler.policy import PolicyConfig, Reason, decide
from scheduler.policy.fairshare import FairShare
from scheduler.policy.predict import predict
from scheduler.policy.priority import breakdown, runtime_factor, waited_head_start
from scheduler.policy.state import Usage
from tests.scheduler.test_policy_support import (
    CLASSES,
    GPULAB,
    GPULAB_PREDICT,
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
DAY = 86400.0
WEEK = 7 * DAY
REF = PolicyConfig().runtime_ref_s  # the default reference: 6 h


def blocked(later, *, run_limit: float | None = None, run_started_ago=600.0):
    """One 4-GPU node, 2 GPUs busy until +1 h (job 90, limit ``run_limit``); a
    4-GPU job (1) waits for them; ``later`` is the job behind it."""
    run = [
        running(
            90, (100, 101), ends_in=HOUR, started_ago=run_started_ago, limit=run_limit
        )
    ]
    return node_gpus(1, 4), run, [pending(1, 4, cls="high"), later]


@pytest.mark.parametrize(
    ("config", "backfilled"),
    [(GPULAB_PREDICT, True), (GPULAB, False), (SLURM, False)],
)
def test_backfill_plans_with_limits_unless_told_to_plan_with_predictions(
    config, backfilled
):
    # predicted 30 min, limit 8 h: fits before the +1 h shadow only by prediction
    gpus, run, jobs = blocked(pending(2, 2, planned=HOUR / 2, limit=8 * HOUR))
    ds = decide(cluster(gpus, jobs, run=run, config=config))
    assert (2 in starts(ds)) is backfilled
    if not backfilled:
        w = waits(ds)[2]
        assert w.reason is Reason.RESERVED_FOR_HIGHER
        assert "planned to run 8h" in w.message


@pytest.mark.parametrize(
    ("config", "shadow"),
    [
        (GPULAB_PREDICT, NOW + HOUR),
        (GPULAB, NOW - 600.0 + DAY),
        (SLURM, NOW - 600.0 + DAY),
    ],
)
def test_the_shadow_time_follows_what_each_policy_plans_with(config, shadow):
    gpus, run, jobs = blocked(pending(2, 1), run_limit=DAY)
    assert waits(decide(cluster(gpus, jobs, run=run, config=config)))[
        1
    ].est_start == pytest.approx(shadow)


def test_a_job_past_its_prediction_is_planned_to_its_limit():
    # job 90 was predicted to run 1 h, has run 2 h: its prediction is violated,
    # so the reservation plans with its limit (6 h after its start), not "now"
    run = [running(90, (100, 101), ends_in=-HOUR, started_ago=2 * HOUR, limit=6 * HOUR)]
    jobs = [pending(1, 4, cls="high"), pending(2, 2, planned=3 * HOUR)]
    ds = decide(cluster(node_gpus(1, 4), jobs, run=run, config=GPULAB_PREDICT))
    assert waits(ds)[1].est_start == pytest.approx(NOW + 4 * HOUR)
    # a 3 h job ends before that shadow: backfilled (planning with the violated
    # prediction would put the shadow at now and hold it back)
    assert starts(ds)[2].backfilled


def test_an_unknown_backfill_plan_is_refused_by_name():
    gpus, run, jobs = blocked(pending(2, 1))
    bad = PolicyConfig(name="gpulab", backfill_plan="oracle")
    with pytest.raises(ValueError, match="unknown backfill plan 'oracle'"):
        decide(cluster(gpus, jobs, run=run, config=bad))


def test_the_runtime_factor_orders_the_queue_whatever_backfill_plans_with():
    # job 2, predicted 1 h (limit a week), goes before the older 1-day job under
    # both plans: the plan changes what backfill protects, not the order
    jobs = [
        pending(1, 1, planned=DAY, age=60.0),
        pending(2, 1, planned=HOUR, limit=WEEK),
    ]
    for config in (GPULAB, GPULAB_PREDICT):
        assert order_of(jobs, config) == [2, 1]


@pytest.mark.parametrize(
    ("planned", "expected"),
    [
        (0.0, 1.0),
        (60.0, 0.9248),
        (HOUR, 0.5540),
        (DAY, 0.2110),
        (WEEK, 0.0),
        (4 * WEEK, 0.0),  # clamped
    ],
)
def test_runtime_factor_values(planned, expected):
    assert runtime_factor(planned, WEEK) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    ("planned", "expected"),
    [(60.0, 0.8823), (600.0, 0.5928), (HOUR, 0.3019), (4 * HOUR, 0.0686), (REF, 0.0)],
)
def test_runtime_factor_values_with_the_default_reference(planned, expected):
    assert REF == 6 * HOUR
    assert runtime_factor(planned, REF) == pytest.approx(expected, abs=1e-3)


def test_jobs_planned_past_the_reference_keep_slurms_order():
    """Shortest-first only among short jobs: a 1-day job does not pass a 3-day
    job that has waited an hour longer (with a week as the reference it did, by
    56 points), while a 1-hour job still passes both."""
    jobs = [
        pending(1, planned=3 * DAY, limit=4 * DAY, age=HOUR),
        pending(2, planned=DAY, limit=2 * DAY),
    ]
    assert order_of(jobs, GPULAB) == order_of(jobs, SLURM) == [1, 2]
    week = PolicyConfig(name="gpulab", runtime_ref_s=WEEK)
    assert order_of(jobs, week) == [2, 1]
    assert order_of([*jobs, pending(3, planned=HOUR)], GPULAB) == [3, 1, 2]


def test_runtime_factor_is_off_without_a_reference():
    assert runtime_factor(60.0, 0.0) == 0.0


def order_of(jobs, config=GPULAB):
    state = cluster(node_gpus(1, 1, busy=(0,)), jobs, config=config)
    ws = sorted(waits(decide(state)).values(), key=lambda w: w.position)
    return [w.job_id for w in ws]


def test_gpulab_ranks_shorter_planned_jobs_first_and_slurm_does_not():
    jobs = [pending(1, planned=DAY, age=60.0), pending(2, planned=600.0)]
    assert order_of(jobs, GPULAB) == [2, 1]
    assert order_of(jobs, SLURM) == [1, 2]  # older first
    breakdown = waits(decide(cluster(node_gpus(1, 1, busy=(0,)), jobs)))[2].breakdown
    assert breakdown["runtime"] == pytest.approx(500 * runtime_factor(600.0, REF))


def test_age_bounds_the_runtime_factor_so_long_jobs_are_not_starved():
    """A week-long job that waited ``max_age`` goes before a brand-new job of one
    minute: the whole runtime weight is at most what a week's age makes up."""
    old_long = pending(1, planned=WEEK, age=WEEK)
    new_short = pending(2, planned=1.0)
    assert order_of([new_short, old_long]) == [1, 2]
    # and before it has aged that long, the short job goes first
    assert order_of([new_short, pending(1, planned=WEEK, age=DAY)]) == [2, 1]


def test_runtime_weight_is_a_setting():
    jobs = [pending(1, planned=DAY, age=60.0), pending(2, planned=600.0)]
    off = PolicyConfig(name="gpulab", weight_runtime=0.0)
    assert order_of(jobs, off) == [1, 2]
    state = cluster(node_gpus(1, 1, busy=(0,)), jobs, config=off)
    assert "runtime" not in waits(decide(state))[2].breakdown


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ([], None),
        ([100.0], 100.0),
        ([100.0, 300.0, 200.0], 300.0),  # the longest: short ones hurt backfill
    ],
)
def test_predict_is_the_longest_recent_run(runs, expected):
    assert predict(runs) == expected


def one_breakdown(job, config=GPULAB, total_gpus=1):
    """``priority.breakdown`` of one job, alone, with no past usage."""
    return breakdown(
        job,
        now=NOW,
        config=config,
        classes=CLASSES,
        fairshare=FairShare(Usage(), {"g"}, {("g", "u")}),
        total_gpus=total_gpus,
        runtime=True,
    )


@pytest.mark.parametrize(
    ("age", "share"),
    [
        (0.0, 1.0),
        (WEEK / 4, 0.75),
        (WEEK / 2, 0.5),
        (WEEK - 60.0, 60.0 / WEEK),
        (WEEK, None),  # max age: the whole weight, as if the job were the shortest
        (2 * WEEK, None),
    ],
)
def test_the_runtime_part_fades_as_age_takes_over(age, share):
    job = pending(2, planned=600.0, age=age)
    ws = waits(decide(cluster(node_gpus(1, 1, busy=(0,)), [job])))
    full = 500 * runtime_factor(600.0, REF)
    expected = 500.0 if share is None else full * share
    assert ws[2].breakdown["runtime"] == pytest.approx(expected)
    # the same numbers as the one-job breakdown
    one = one_breakdown(job)
    assert one == pytest.approx(dict(ws[2].breakdown))


@pytest.mark.parametrize(
    ("old", "new", "old_first"),
    [
        # one class up: a max-aged job passes new ones, however short they are
        (("normal", WEEK), ("high", 60.0), True),
        (("best-effort", 4 * WEEK), ("normal", 1.0), True),
        # two classes up: never, even against a job longer than the reference
        (("best-effort", 4 * WEEK), ("high", 4 * WEEK), False),
    ],
)
def test_age_crosses_one_class_step_whatever_the_run_times(old, new, old_first):
    """At max age, and not a day before it."""
    old_cls, old_planned = old
    new_cls, new_planned = new
    for age, expected in (
        (WEEK, old_first),
        (WEEK - DAY, False),
        (52 * WEEK, old_first),
    ):
        jobs = [
            pending(1, cls=old_cls, planned=old_planned, age=age),
            pending(2, cls=new_cls, planned=new_planned),
        ]
        assert (order_of(jobs)[0] == 1) is expected, (old, new, age)


@pytest.mark.parametrize(
    ("waited", "gpus", "age_gpu_s", "expected"),
    [
        (HOUR, 8, 48 * HOUR, 8 / 48),
        (6 * HOUR, 8, 48 * HOUR, 1.0),  # 48 GPU-hours: the shortest job's start
        (6 * HOUR, 1, 48 * HOUR, 6 / 48),  # eight times slower for one GPU
        (DAY, 8, 48 * HOUR, 1.0),  # capped
        (DAY, 8, 0.0, 0.0),  # off
        (0.0, 0, 48 * HOUR, 0.0),
    ],
)
def test_the_head_start_earned_by_waiting_grows_with_gpu_hours_waited(
    waited, gpus, age_gpu_s, expected
):
    got = waited_head_start(NOW, NOW - waited, gpus, age_gpu_s)
    assert got == pytest.approx(expected)


def wide_and_short(wide_age: float, narrow_age: float = 0.0):
    """An 8-GPU job planned 8 h (no run-time factor of its own) that has waited
    ``wide_age`` and a 1-GPU job planned 1 h; 64 GPUs, all busy (so the size
    factor, 8/64 of its weight, does not decide)."""
    return [
        pending(1, 8, planned=8 * HOUR, age=wide_age),
        pending(2, 1, planned=HOUR, age=narrow_age),
    ]


def wide_order(jobs, config):
    gpus = node_gpus(1, 8, busy=tuple(range(8))) + node_gpus(
        2, 56, busy=tuple(range(56))
    )
    state = cluster(gpus, jobs, config=config)
    ws = sorted(waits(decide(state)).values(), key=lambda w: w.position)
    return [w.job_id for w in ws], {w.job_id: w.breakdown for w in ws}


def test_a_wide_job_earns_the_short_jobs_head_start_by_gpu_hours_waited():
    """The rule that keeps a stream of short 1-GPU jobs from passing a wide job for
    days (docs/policy.md, "(d)'s wide jobs"): off by default, where the 1-hour job
    goes first; with 48 GPU-hours, the 8-GPU job that waited 6 h has the whole
    run-time weight and goes first, and one that waited 1 h does not yet."""
    rule = PolicyConfig(name="gpulab", runtime_age_gpu_s=48 * HOUR)
    assert wide_order(wide_and_short(6 * HOUR), GPULAB)[0] == [2, 1]
    order, parts = wide_order(wide_and_short(6 * HOUR), rule)
    assert order == [1, 2]
    assert parts[1]["runtime"] == pytest.approx(500.0)
    # the short job keeps its own head start: it has earned less by waiting
    assert parts[2]["runtime"] == pytest.approx(500 * runtime_factor(HOUR, REF))
    assert wide_order(wide_and_short(HOUR), rule)[0] == [2, 1]
    # the same numbers as the one-job breakdown
    one = one_breakdown(pending(1, 8, planned=8 * HOUR, age=2 * HOUR), rule, 8)
    assert one["runtime"] == pytest.approx(500 * 16 / 48)


def test_a_narrow_job_earns_its_head_start_eight_times_slower():
    """A 1-GPU job planned 8 h that waited 6 h (6 GPU-hours of 48) stays behind a
    new 1-hour job; after 48 h it has the shortest job's start and goes first."""
    rule = PolicyConfig(name="gpulab", runtime_age_gpu_s=48 * HOUR)
    jobs = [pending(1, planned=8 * HOUR, age=6 * HOUR), pending(2, planned=HOUR)]
    assert order_of(jobs, rule) == [2, 1]
    jobs = [pending(1, planned=8 * HOUR, age=48 * HOUR), pending(2, planned=HOUR)]
    assert order_of(jobs, rule) == [1, 2]


def test_only_wide_jobs_earn_the_head_start_when_told():
    """``runtime_age_min_gpus`` 5: the 8-GPU job that waited 6 h (48 GPU-hours)
    still earns the shortest job's start, a 4-GPU job that waited 12 h earns
    none and keeps its own run-time part (0, planned 8 h), behind the 1-hour
    job; the one-job breakdown agrees."""
    wide_only = PolicyConfig(
        name="gpulab", runtime_age_gpu_s=48 * HOUR, runtime_age_min_gpus=5
    )
    order, parts = wide_order(wide_and_short(6 * HOUR), wide_only)
    assert order == [1, 2]
    assert parts[1]["runtime"] == pytest.approx(500.0)
    four = [pending(1, 4, planned=8 * HOUR, age=12 * HOUR), pending(2, 1)]
    order, parts = wide_order(four, wide_only)
    assert order == [2, 1]
    assert parts[1]["runtime"] == pytest.approx(0.0)
    every = PolicyConfig(name="gpulab", runtime_age_gpu_s=48 * HOUR)
    assert wide_order(four, every)[0] == [1, 2]
    assert one_breakdown(four[0], wide_only, 8)["runtime"] == pytest.approx(0.0)
    one = one_breakdown(pending(1, 8, planned=8 * HOUR, age=2 * HOUR), wide_only, 8)
    assert one["runtime"] == pytest.approx(500 * 16 / 48)
