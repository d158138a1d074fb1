"""``run_pass``'s ``PassStats``: the exact counts and stop reason of small passes,
and stage times that are only measured, never read by a decision."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import pytest

from scheduler.policy import PassStats, PolicyConfig, run_pass
from scheduler.policy.state import (
    STAGES,
    STOP_BACKFILL_MAX_TESTED,
    STOP_BACKFILL_OFF,
    STOP_QUEUE_EXHAUSTED,
    STOP_REASONS,
)
from tests.scheduler.test_policy_colocate_pass import gpus, resident, sharer
from tests.scheduler.test_policy_colocate_pass import state as colo_state
from tests.scheduler.test_policy_support import (
    SLURM,
    cluster,
    node_gpus,
    pending,
    running,
)


def counts(stats: PassStats) -> tuple[int, int, int, int, int, str]:
    return (
        stats.considered,
        stats.started,
        stats.preempted,
        stats.reserved,
        stats.backfilled,
        stats.stop_reason,
    )


def blocked(jobs, config=None, **cfg):
    """Two GPUs, GPU 100 busy for an hour; job 1 (2 GPUs, highest priority as the
    largest) blocks, ``jobs`` come after it."""
    top = pending(1, gpus=2, age=60.0)
    kw = {"config": config} if config is not None else {}
    return cluster(node_gpus(1, 2), [top, *jobs], run=[running(7, (100,))], **kw, **cfg)


def test_the_stop_reasons_are_named_once():
    assert STOP_REASONS == ("queue exhausted", "backfill_max_tested", "backfill off")
    assert PassStats().stop_reason == STOP_QUEUE_EXHAUSTED


def test_an_empty_queue_considers_nothing():
    got = run_pass(cluster(node_gpus(1, 2), []))
    assert counts(got.stats) == (0, 0, 0, 0, 0, STOP_QUEUE_EXHAUSTED)


@pytest.mark.parametrize(("name", "started"), [("first-fit", 2), ("fifo", 1)])
def test_fifo_counts_its_starts_and_always_reaches_the_end(name, started):
    # job 2 does not fit: first-fit still starts job 3, strict fifo holds it
    jobs = [pending(1), pending(2, gpus=2), pending(3)]
    got = run_pass(cluster(node_gpus(1, 2), jobs, config=PolicyConfig(name=name)))
    assert counts(got.stats) == (3, started, 0, 0, 0, STOP_QUEUE_EXHAUSTED)
    assert set(got.stats.stage_s) == {"ordering", "placement"}


# gpulab without the run-time factor, which would put the short job first
@pytest.mark.parametrize("config", [SLURM, PolicyConfig(weight_runtime=0.0)])
def test_a_reservation_and_a_backfilled_start(config):
    jobs = [pending(2, planned=600.0), pending(3, planned=7200.0)]
    got = run_pass(blocked(jobs, config))
    # job 2 ends before the shadow time and backfills; job 3 would delay job 1
    assert counts(got.stats) == (3, 1, 0, 1, 1, STOP_QUEUE_EXHAUSTED)
    assert tuple(got.stats.stage_s) == STAGES
    assert all(s >= 0.0 for s in got.stats.stage_s.values())


def test_in_order_starts_are_not_backfilled_and_no_start_plans_nothing():
    jobs = [pending(1), pending(2)]
    got = run_pass(cluster(node_gpus(1, 2), jobs))
    assert counts(got.stats) == (2, 2, 0, 0, 0, STOP_QUEUE_EXHAUSTED)
    down = (node_gpus(1, 2)[0], replace(node_gpus(1, 2)[1], schedulable=False))
    got = run_pass(cluster(down, [pending(1, gpus=2)], run=[running(7, (100,))]))
    # the top job has no planned start: it is considered but not reserved
    assert counts(got.stats) == (1, 0, 0, 0, 0, STOP_QUEUE_EXHAUSTED)


def test_a_preemption_counts_its_victims_and_the_reservation():
    s = cluster(
        node_gpus(1, 2),
        [pending(1, gpus=2, cls="high")],
        run=[
            running(7, (100,), cls="best-effort"),
            running(8, (101,), cls="best-effort"),
        ],
    )
    got = run_pass(s)
    assert counts(got.stats) == (1, 0, 2, 1, 0, STOP_QUEUE_EXHAUSTED)


def test_the_backfill_test_budget_stops_the_pass():
    jobs = [pending(i, planned=7200.0) for i in (2, 3, 4)]
    got = run_pass(blocked(jobs, backfill_max_tested=2))
    assert counts(got.stats) == (4, 0, 0, 1, 0, STOP_BACKFILL_MAX_TESTED)
    # a budget that just covers the jobs after the top one is not a stop
    got = run_pass(blocked(jobs, backfill_max_tested=3))
    assert counts(got.stats) == (4, 0, 0, 1, 0, STOP_QUEUE_EXHAUSTED)


def test_backfill_off_stops_at_the_top_blocked_job():
    jobs = [pending(2, planned=600.0)]
    got = run_pass(blocked(jobs, SLURM, backfill=False))
    assert counts(got.stats) == (2, 0, 0, 1, 0, STOP_BACKFILL_OFF)
    # nothing after the top blocked job: the pass reached the end of the queue
    got = run_pass(blocked([], SLURM, backfill=False))
    assert counts(got.stats) == (1, 0, 0, 1, 0, STOP_QUEUE_EXHAUSTED)


def test_a_shared_start_counts_as_a_start():
    s = colo_state(gpus(1, 1, busy={0: 1}), [sharer(1)], [resident(9, 100)])
    got = run_pass(s)
    assert counts(got.stats) == (1, 1, 0, 0, 0, STOP_QUEUE_EXHAUSTED)
    assert got.stats.stage_s["colocation"] > 0.0


def test_stage_times_are_measured_and_never_decide(monkeypatch):
    jobs = [pending(2, planned=600.0), pending(3, planned=7200.0)]
    s = blocked(jobs)
    before = run_pass(s).decisions
    ticks = itertools.count(0.0, 1000.0)  # every reading 1000 s after the last
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    got = run_pass(s)
    assert got.decisions == before
    # each stage is one timed call (two readings, 1000 s apart); setup is two
    # (the context, then the quota stops that follow the evictions)
    assert got.stats.stage_s == {**dict.fromkeys(STAGES, 1000.0), "setup": 2000.0}
