"""A running job's expected end from its reported progress (``policy.remaining``)
and where the pass reads it: reservations, backfill and the planned starts shown
to waiting jobs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.policy import Reason, decide
from scheduler.policy.remaining import (
    SHOWN_MARGIN_S,
    SHOWN_MARGIN_SHARE,
    Progress,
    expected_end,
    from_reports,
    shown_end,
)
from tests.scheduler.test_policy_support import (
    GPULAB,
    GPULAB_PREDICT,
    NOW,
    SLURM,
    cluster,
    node_gpus,
    pending,
    running,
    starts,
)

HOUR = 3600.0


def test_progress_end_is_the_remaining_steps_at_the_rate_from_the_latest_read():
    p = Progress(step=400, total=1000, at=NOW - 60, rate=0.5)
    # 600 steps at 0.5/s = 1200 s after the read, which was 60 s ago
    assert p.end(NOW) == NOW - 60 + 1200


@pytest.mark.parametrize(
    "p",
    [
        Progress(step=400, total=1000, at=NOW, rate=0.0),  # no rate
        Progress(step=400, total=1000, at=NOW, rate=-1.0),  # restarted lower
        Progress(step=1000, total=1000, at=NOW, rate=1.0),  # total reached
        Progress(step=1200, total=1000, at=NOW, rate=1.0),  # past the total
        Progress(step=10, total=1000, at=NOW - 5000, rate=1.0),  # end passed
        Progress(step=10, total=0, at=NOW, rate=1.0),  # no total
    ],
)
def test_progress_that_says_nothing_gives_no_end(p):
    assert p.end(NOW) is None


def test_expected_end_is_capped_by_the_limit():
    p = Progress(step=100, total=1000, at=NOW, rate=0.1)  # 9000 s to go
    got = expected_end(NOW - 600, 900.0, 3600.0, NOW, p, predictions=True)
    assert got == NOW - 600 + 3600.0


def test_expected_end_prefers_progress_over_the_plan_either_way():
    p = Progress(step=500, total=1000, at=NOW, rate=1.0)
    for predictions in (True, False):
        got = expected_end(NOW - 600, 7200.0, 86400.0, NOW, p, predictions=predictions)
        assert got == NOW + 500


@pytest.mark.parametrize(
    ("predictions", "planned", "want"),
    [
        (True, 7200.0, NOW - 600 + 7200.0),  # the plan, still ahead
        (True, 300.0, NOW - 600 + 86400.0),  # outlived its plan: the limit
        (False, 7200.0, NOW - 600 + 86400.0),  # plans with limits
    ],
)
def test_without_progress_the_plan_holds(predictions, planned, want):
    stale = Progress(step=1000, total=1000, at=NOW, rate=1.0)
    for p in (None, stale):
        got = expected_end(NOW - 600, planned, 86400.0, NOW, p, predictions=predictions)
        assert got == want


def test_from_reports_measures_the_rate_over_the_window():
    got = from_reports(700, 1000, NOW, 100, NOW - 1200)
    assert got == Progress(700.0, 1000.0, NOW, 0.5)


@pytest.mark.parametrize(
    "row",
    [
        (None, None, None, None, None),  # never reported
        (700, None, NOW, 100, NOW - 1200),  # no total
        (100, 1000, NOW, 100, NOW),  # one report only
        (700, 1000, NOW, None, None),
    ],
)
def test_from_reports_needs_two_reports_apart_and_a_total(row):
    assert from_reports(*row) is None


def blocked_by(progress: Progress | None):
    """Node 1: 4 GPUs, 2 held by job 90 until its limit at +10 h (planned with
    limits); a 4-GPU job (1) waits for them; job 2 (2 GPUs, 2 h) could backfill."""
    run = replace(running(90, (100, 101), ends_in=10 * HOUR), progress=progress)
    return node_gpus(1, 4), run


def test_a_reservation_waits_for_the_end_progress_gives():
    gpus, run = blocked_by(Progress(step=500, total=1000, at=NOW, rate=1000 / 3600))
    ds = decide(cluster(gpus, [pending(1, 4, cls="high")], run=[run]))
    [w] = ds
    assert w.reason is Reason.RESOURCES
    # 500 steps at 1000/h: 30 min; shown with the margin (2 min + 10 % of 30 min)
    assert w.est_start == pytest.approx(NOW + 1800 + 120 + 180)
    assert "when job 90 is planned to end" in w.message


def test_slurm_and_the_off_switch_keep_planning_with_limits():
    gpus, run = blocked_by(Progress(step=500, total=1000, at=NOW, rate=1000 / 3600))
    for config in (SLURM, replace(GPULAB, progress_ends=False)):
        [w] = decide(
            cluster(gpus, [pending(1, 4, cls="high")], run=[run], config=config)
        )
        assert w.est_start == NOW + 10 * HOUR


def test_backfill_reads_the_progress_end():
    """Job 2 (2 GPUs, 2 h) would delay job 1 if job 90 ends in 30 min by its
    progress; with no progress, job 90 holds its GPUs 10 h and job 2 backfills."""
    jobs = [pending(1, 4, cls="high"), pending(2, 2, planned=2 * HOUR)]
    gpus, run = blocked_by(Progress(step=500, total=1000, at=NOW, rate=1000 / 3600))
    assert starts(decide(cluster(gpus, jobs, run=[run]))) == {}
    gpus, run = blocked_by(None)
    assert set(starts(decide(cluster(gpus, jobs, run=[run])))) == {2}


def test_progress_also_overrides_a_violated_prediction():
    """Under ``backfill_plan = "prediction"`` a job past its prediction is planned
    to its limit, unless its progress says when it ends."""
    run = replace(
        running(90, (100, 101), ends_in=10 * HOUR, started_ago=7200),
        planned_s=3600.0,
    )
    gpus = node_gpus(1, 4)
    [w] = decide(cluster(gpus, [pending(1, 4)], run=[run], config=GPULAB_PREDICT))
    assert w.est_start == NOW + 10 * HOUR
    run = replace(run, progress=Progress(900, 1000, NOW - 60, 0.1))
    [w] = decide(cluster(gpus, [pending(1, 4)], run=[run], config=GPULAB_PREDICT))
    end = NOW - 60 + 1000
    assert w.est_start == pytest.approx(end + 120 + 0.1 * (end - NOW))


def test_shown_end_adds_the_margin_to_an_end_from_progress_only():
    p = Progress(step=500, total=1000, at=NOW, rate=1.0)  # ends at +500 s
    got = shown_end(NOW - 600, 7200.0, 86400.0, NOW, p, predictions=True)
    assert got == NOW + 500 + SHOWN_MARGIN_S + SHOWN_MARGIN_SHARE * 500
    # never past the limit
    assert shown_end(NOW - 600, 7200.0, 1200.0, NOW, p, predictions=True) == (
        NOW - 600 + 1200.0
    )
    # an end from the plan is the plan's: the limit is already an upper bound
    for predictions in (True, False):
        assert shown_end(
            NOW - 600, 7200.0, 86400.0, NOW, None, predictions=predictions
        ) == expected_end(
            NOW - 600, 7200.0, 86400.0, NOW, None, predictions=predictions
        )


def test_the_margin_is_only_shown_decisions_plan_with_the_estimate():
    """Job 90 ends in 30 min by its progress; job 1 is shown a start 35 min
    ahead (with the margin) but its reservation decides with 30 min: job 2,
    planned 32 min, would end past the shadow time and waits; job 3, planned
    28 min, backfills."""
    gpus, run = blocked_by(Progress(step=500, total=1000, at=NOW, rate=1000 / 3600))
    top = pending(1, 4, cls="high")
    w1, w2 = decide(cluster(gpus, [top, pending(2, 2, planned=32 * 60.0)], run=[run]))
    assert w1.est_start == pytest.approx(NOW + 2100)
    assert w2.reason is Reason.RESERVED_FOR_HIGHER
    ds = decide(cluster(gpus, [top, pending(3, 2, planned=28 * 60.0)], run=[run]))
    assert set(starts(ds)) == {3}
