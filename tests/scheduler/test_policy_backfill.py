"""EASY backfill (the reservation and backfill stages) and the one-reason-per-job
rule (the reasons stage)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from scheduler.policy import ClusterState, GpuView, Reason, RunningJob, Start, decide
from tests.scheduler.test_policy_support import (
    GPULAB,
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


def two_nodes():
    """Node 1: 4 GPUs, 2 busy until +1 h (job 90). Node 2: 4 GPUs, 3 busy until
    +2 h (job 91). A 4-GPU job (1) is blocked and reserves node 1 at +1 h."""
    run = [
        running(90, (100, 101), ends_in=HOUR),
        running(91, (200, 201, 202), ends_in=2 * HOUR),
    ]
    return node_gpus(1, 4) + node_gpus(2, 4), run


@pytest.mark.parametrize("config", [GPULAB, SLURM])
def test_the_top_blocked_job_gets_resources_and_its_shadow_time(config):
    gpus, run = two_nodes()
    ds = decide(cluster(gpus, [pending(1, 4, cls="high")], run=run, config=config))
    [w] = ds
    assert w.reason is Reason.RESOURCES
    assert w.est_start == NOW + HOUR
    assert "reserved to start at" in w.message
    assert "in 1h 00m" in w.message
    assert "when job 90 is planned to end" in w.message
    assert "at most 2 free on one node now" in w.message


@pytest.mark.parametrize(
    ("job", "started", "reason"),
    [
        # short: ends before the shadow time, may use the reserved GPUs
        (pending(2, 2, planned=HOUR - 60), True, None),
        (pending(2, 2, planned=HOUR), True, None),  # ends exactly at the shadow
        # long, 1 GPU: node 2's free GPU is outside the reservation
        (pending(2, 1, planned=10 * HOUR), True, None),
        # long, 2 GPUs: only node 1 (reserved) fits: held back
        (pending(2, 2, planned=10 * HOUR), False, Reason.RESERVED_FOR_HIGHER),
        # does not fit the free GPUs now at all
        (pending(2, 3, planned=60.0), False, Reason.RESOURCES),
    ],
)
@pytest.mark.parametrize("config", [GPULAB, SLURM])
def test_backfill_rules(job, started, reason, config):
    gpus, run = two_nodes()
    ds = decide(cluster(gpus, [pending(1, 4, cls="high"), job], run=run, config=config))
    if started:
        s = starts(ds)[2]
        assert s.backfilled
        if job.planned_s > HOUR:
            assert s.placements[0].node_id == 2
    else:
        assert 2 not in starts(ds)
        assert waits(ds)[2].reason is reason
    assert waits(ds)[1].est_start == NOW + HOUR


def test_the_held_back_job_is_told_why_with_numbers():
    gpus, run = two_nodes()
    ds = decide(
        cluster(
            gpus, [pending(1, 4, cls="high"), pending(2, 2, planned=10 * HOUR)], run=run
        )
    )
    w = waits(ds)[2]
    assert "2 GPUs are free now, but it would delay job 1" in w.message
    assert "planned to run 10h 00m" in w.message


def test_without_backfill_later_jobs_wait_for_priority():
    gpus, run = two_nodes()
    jobs = [pending(1, 4, cls="high"), pending(2, 1, planned=60.0)]
    ds = decide(cluster(gpus, jobs, run=run, backfill=False))
    assert not starts(ds)
    assert waits(ds)[2].reason is Reason.PRIORITY
    assert "behind job 1" in waits(ds)[2].message


def test_jobs_past_the_tested_cap_are_not_tested():
    gpus, run = two_nodes()
    jobs = [pending(1, 4, cls="high")] + [
        pending(i, 8 if i < 5 else 1, age=100 - i, planned=60.0) for i in range(2, 12)
    ]
    ds = decide(cluster(gpus, jobs, run=run, backfill_max_tested=3))
    ws = waits(ds)
    assert ws[1].reason is Reason.RESOURCES
    # 2, 3, 4 (8 GPUs: fit the cluster, not the free GPUs) are the tested three
    assert [ws[i].reason for i in (2, 3, 4)] == [Reason.RESOURCES] * 3
    for i in range(5, 12):
        assert ws[i].reason is Reason.NOT_TESTED
        assert "after 3 jobs" in ws[i].message
    assert not starts(ds)


def test_an_unplannable_top_job_gets_no_reservation_and_does_not_block():
    # the top job needs a node that is busy with something no running job explains
    gpus = node_gpus(1, 4, busy=(0,)) + node_gpus(2, 1)
    ds = decide(cluster(gpus, [pending(1, 4, cls="high"), pending(2, 1, planned=1e6)]))
    w = waits(ds)[1]
    assert w.est_start is None
    assert "no start can be planned" in w.message
    assert starts(ds)[2].backfilled


@pytest.mark.parametrize("config", [GPULAB, SLURM])
def test_exactly_one_decision_per_pending_job(config):
    rng = random.Random(7)
    for _ in range(50):
        state = random_state(rng, config)
        ds = decide(state)
        ids = [d.job_id for d in ds if isinstance(d, Start)] + [
            d.job_id for d in ds if not isinstance(d, Start) and hasattr(d, "position")
        ]
        assert sorted(ids) == sorted(j.id for j in state.pending)
        positions = sorted(w.position for w in waits(ds).values())
        assert positions == list(range(1, len(positions) + 1))
        # no GPU is given twice, and only free schedulable GPUs are given
        taken = [g for st in starts(ds).values() for g in st.gpu_ids]
        assert len(taken) == len(set(taken))
        free = {g.id for g in state.gpus if g.free_slots == g.slots and g.schedulable}
        assert set(taken) <= free
        for st in starts(ds).values():
            nodes = [p.node_id for p in st.placements]
            assert len(nodes) == len(set(nodes))  # one Placement per node
            assert all(
                state.gpus[[x.id for x in state.gpus].index(g)].node_id == p.node_id
                for p in st.placements
                for g in p.gpu_ids
            )


# ---------------------------------------------------------------- property check


def random_state(rng: random.Random, config) -> ClusterState:
    gpus: tuple[GpuView, ...] = ()
    for n in range(1, rng.randint(2, 4) + 1):
        gpus += node_gpus(n, rng.choice((2, 4, 8)))
    ids = [g.id for g in gpus]
    rng.shuffle(ids)
    run = []
    jid = 1000
    while ids and rng.random() < 0.85:
        k = min(len(ids), rng.choice((1, 1, 2, 4)))
        same_node = [g for g in ids if g // 100 == ids[0] // 100][:k]
        for g in same_node:
            ids.remove(g)
        run.append(
            running(
                jid,
                tuple(same_node),
                ends_in=rng.choice((60, 600, 3600, 7200)) * rng.random() + 1,
            )
        )
        jid += 1
    jobs = [
        pending(
            i,
            rng.choice((1, 1, 2, 3, 4, 6, 8)),
            cls=rng.choice(("high", "normal")),
            age=rng.random() * 86400,
            planned=rng.choice((120.0, 1800.0, 5400.0, 36000.0)),
        )
        for i in range(1, rng.randint(2, 12))
    ]
    return cluster(gpus, jobs, run=run, config=config)


def at(state: ClusterState, t: float, started: list[Start]) -> ClusterState:
    """The state at time t if every job ends at its planned end."""
    now_running = [
        *state.running,
        *(
            RunningJob(s.job_id, s.gpu_ids, state.now, p.planned_s, p.time_limit_s)
            for s in started
            for p in state.pending
            if p.id == s.job_id
        ),
    ]
    still = [r for r in now_running if r.planned_end > t]
    busy = {g for r in still for g in r.gpu_ids}
    gpus = tuple(
        replace(g, free_slots=0 if g.id in busy else g.slots) for g in state.gpus
    )
    return replace(state, now=t, gpus=gpus, running=tuple(still), pending=())


@pytest.mark.parametrize("config", [GPULAB, SLURM])
@pytest.mark.parametrize("seed", range(40))
def test_backfill_never_delays_the_reservation(config, seed):
    rng = random.Random(seed)
    for _ in range(10):
        state = random_state(rng, config)
        ds = decide(state)
        reserved = [w for w in waits(ds).values() if w.est_start is not None]
        if not reserved:
            continue
        [top] = reserved  # one reservation per pass
        assert top.reason is Reason.RESOURCES
        started = list(starts(ds).values())
        job = next(p for p in state.pending if p.id == top.job_id)
        later = replace(at(state, top.est_start, started), pending=(job,))
        assert isinstance(decide(later)[0], Start), (seed, top, started)
        # and not earlier: at the last planned end before it, without the
        # backfilled jobs, the job did not fit yet
        assert top.est_start >= state.now
        unfilled = [s for s in started if not s.backfilled]
        ends = [r.planned_end for r in at(state, state.now, unfilled).running]
        before = [t for t in ends if state.now <= t < top.est_start]
        if before:
            no_bf = replace(at(state, max(before), unfilled), pending=(job,))
            assert not isinstance(decide(no_bf)[0], Start)


def test_the_property_check_sees_reservations_backfills_and_gangs():
    """Guard against a vacuous property test: the random states exercise it."""
    rng = random.Random(0)
    seen = {"reserved": 0, "backfilled": 0, "gang_reserved": 0}
    for _ in range(200):
        state = random_state(rng, GPULAB)
        ds = decide(state)
        for w in waits(ds).values():
            if w.est_start is not None:
                seen["reserved"] += 1
                if "across nodes" in w.message:
                    seen["gang_reserved"] += 1
        seen["backfilled"] += sum(1 for s in starts(ds).values() if s.backfilled)
    assert all(v >= 5 for v in seen.values()), seen
