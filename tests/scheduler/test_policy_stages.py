"""Each stage of the multifactor pass (``policy.stages``) on its own: a ``Pass``
built over a small state, one stage called, its effect on the context checked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.policy import Dependency, Evict, Preempt, QuotaStop, QuotaView, Reason
from scheduler.policy import stages as st
from scheduler.policy.state import STOP_BACKFILL_MAX_TESTED, STOP_BACKFILL_OFF
from tests.scheduler.test_policy_colocate_pass import (
    KNOWN_BAD,
    gpus,
    resident,
    sharer,
)
from tests.scheduler.test_policy_colocate_pass import state as colo_state
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


def make(state, *, preemption=True, runtime=True):
    return st.Pass(
        state, preemption=preemption, topology=True, predictions=False,
        runtime=runtime,
    )  # fmt: skip


def later_of(p):
    """job id -> (reason, message, est) of the waits recorded so far."""
    return {j.id: (r, m, e) for j, r, m, e, _ in p.later}


# ------------------------------------------------------------------ setup


def test_stop_overruns_stops_the_jobs_of_a_used_up_hard_quota():
    quota = QuotaView(1, group="g", gpu_hours=10.0, used_gpu_hours=12.0)
    s = replace(
        cluster(node_gpus(1, 2), [], run=[running(7, (100,))], quota_overrun="stop"),
        quotas=(quota,),
    )
    p = make(s)
    st.stop_overruns(p)
    assert [(type(d), d.job_id) for d in p.decisions] == [(QuotaStop, 7)]
    p = make(replace(s, config=replace(s.config, quota_overrun="finish")))
    st.stop_overruns(p)
    assert p.decisions == []


def test_share_setup_evicts_a_pair_over_its_cap_and_indexes_joinable_gpus():
    over = resident(8, 100, "a", measured_slowdown=2.0, measured_for_s=600.0)
    joiner = resident(9, 100, "b", joined_at=NOW - 900)
    p = make(
        colo_state(gpus(1, 2, busy={0: 2, 1: 1}), [], [over, joiner, resident(7, 101)])
    )
    st.share_setup(p, "full", None)
    assert [(type(d), d.job_id) for d in p.decisions] == [(Evict, 9)]
    assert p.sharing is not None
    assert set(p.sharing.free) == {101}  # 100 holds an evicted job
    p = make(colo_state(gpus(1, 1), [], [over, joiner]))
    st.share_setup(p, None, None)
    assert p.decisions == []
    assert p.sharing is None


# ------------------------------------------------------------------ ordering


def test_ordering_ranks_by_priority_then_submit_time_then_id():
    jobs = [
        pending(1, age=10.0),
        pending(2, cls="high"),
        pending(3, age=10.0),
        pending(4, age=20.0),
    ]
    p = make(cluster(node_gpus(1, 1), jobs, config=SLURM), runtime=False)
    assert [j.id for j in st.ordering(p)] == [2, 4, 1, 3]
    assert p.prio[2] == pytest.approx(sum(p.breakdowns[2].values()))
    assert "runtime" not in p.breakdowns[2]


# ------------------------------------------------------------------ placement


def test_gate_holds_jobs_a_node_independent_rule_refuses():
    dep = replace(pending(1), dependencies=(Dependency("afterok", 9, "running"),))
    huge = pending(2, gpus=3)
    p = make(cluster(node_gpus(1, 2), [dep, huge, pending(3), pending(4)]))
    assert st.gate(p, dep) is None
    assert st.gate(p, huge) is None
    c3, c4 = st.gate(p, p.state.pending[2]), st.gate(p, p.state.pending[3])
    assert c3 is not None and c3 is c4  # one lookup per shape
    got = later_of(p)
    assert set(got) == {1, 2}
    assert got[1][0] is Reason.DEPENDENCY
    assert got[2][0] is Reason.NO_SUCH_SHAPE


def test_place_in_order_starts_jobs_until_the_first_that_does_not_fit():
    jobs = [pending(1), pending(2, gpus=2), pending(3)]
    p = make(cluster(node_gpus(1, 2), jobs))
    top, c = st.place_in_order(p, jobs)
    assert (top, c) == (1, p.idx.constraint(jobs[1]))
    assert [(d.job_id, d.gpu_ids, d.backfilled) for d in p.decisions] == [
        (1, (100,), False)
    ]
    assert [r.id for r in p.started] == [1]
    assert p.later == []  # the top job's wait is the reservation stage's
    assert st.place_in_order(make(cluster(node_gpus(1, 2), jobs[:1])), jobs[:1]) == (
        1,
        None,
    )


def test_try_place_remembers_a_miss_for_the_shape():
    p = make(cluster(node_gpus(1, 2), []))
    big = pending(1, gpus=2)
    c = p.idx.constraint(big)
    p.ledger.take(1, (100,))
    assert st.try_place(p, big, c, avoid_reserved=False) is None
    assert p.failed == {(False, False, c): 2}
    p.ledger.give(1, (p.idx.gpu_by_id[100],))
    assert st.try_place(p, big, c, avoid_reserved=False) is None  # cached miss


def test_share_starts_a_job_beside_a_resident_and_records_a_refusal():
    s = colo_state(gpus(1, 1, busy={0: 1}), [sharer(1)], [resident(9, 100)])
    p = make(s)
    st.share_setup(p, "full", None)
    job = s.pending[0]
    assert st.share(p, job, p.idx.constraint(job), bf=True, avoid=False)
    (d,) = p.decisions
    assert (d.job_id, d.gpu_ids, d.backfilled) == (1, (100,), True)
    assert d.admission is not None and d.admission.partners == (9,)
    assert p.stage_s["colocation"] > 0.0
    p = make(replace(s, knowledge=KNOWN_BAD))
    st.share_setup(p, "full", None)
    assert not st.share(p, job, p.idx.constraint(job), bf=False, avoid=False)
    assert p.decisions == []
    assert p.refusals[1].startswith("; sharing a GPU refused: jobs 1 and 9")


# ------------------------------------------------------------------ reservation


def test_reserve_top_reserves_the_shadow_time_from_planned_ends():
    big = pending(1, gpus=2)
    s = cluster(node_gpus(1, 2), [big], run=[running(7, (100,), ends_in=1800.0)])
    p = make(s)
    st.reserve_top(p, big, p.idx.constraint(big))
    assert p.top is big and p.reserved == 1
    assert p.reservation is not None
    assert p.reservation.shadow == NOW + 1800.0
    assert p.reservation.gpu_ids == frozenset({100, 101})
    reason, message, est = later_of(p)[1]
    assert (reason, est) == (Reason.RESOURCES, NOW + 1800.0)
    assert "when job 7 is planned to end" in message


def test_reserve_top_without_a_planned_end_reserves_nothing():
    big = pending(1, gpus=2)
    down = (*node_gpus(1, 2)[:1], replace(node_gpus(1, 2)[1], schedulable=False))
    p = make(cluster(down, [big], run=[running(7, (100,))]))
    st.reserve_top(p, big, p.idx.constraint(big))
    assert p.reserved == 0
    assert p.reservation is not None and p.reservation.shadow is None


def test_reserve_top_preempts_best_effort_for_a_higher_class():
    boss = pending(1, cls="high")
    s = cluster(node_gpus(1, 1), [boss], run=[running(7, (100,), cls="best-effort")])
    p = make(s)
    st.reserve_top(p, boss, p.idx.constraint(boss))
    assert [(type(d), d.victim_id, d.for_job_id) for d in p.decisions] == [
        (Preempt, 7, 1)
    ]
    assert p.reserved == 1
    assert p.reservation is not None and p.reservation.victims == (7,)
    assert later_of(p)[1][0] is Reason.WAITING_FOR_PREEMPTION
    # the same job in slurm (no preemption) gets the shadow-time reservation
    p = make(s, preemption=False)
    st.reserve_top(p, boss, p.idx.constraint(boss))
    assert p.decisions == [] and p.reservation.victims == ()


# ------------------------------------------------------------------ backfill


def blocked_pass(jobs, **cfg):
    """Two GPUs, one busy for an hour; job 1 (2 GPUs) is the top blocked job."""
    top = pending(1, gpus=2)
    s = cluster(node_gpus(1, 2), [top, *jobs], run=[running(7, (100,))], **cfg)
    p = make(s)
    st.ordering(p)
    st.reserve_top(p, top, p.idx.constraint(top))
    return p


def test_backfill_one_starts_a_job_that_ends_by_the_shadow_time():
    short, long_ = pending(2, planned=600.0), pending(3, planned=7200.0)
    p = blocked_pass([short, long_])
    st.backfill_one(p, short, p.idx.constraint(short))
    st.backfill_one(p, long_, p.idx.constraint(long_))
    assert [(d.job_id, d.backfilled) for d in p.decisions] == [(2, True)]
    reason, _message, _ = later_of(p)[3]
    assert reason is Reason.RESOURCES  # job 2 took the last free GPU


def test_backfill_one_keeps_a_long_job_off_the_reserved_gpus():
    long_ = pending(3, planned=7200.0)
    p = blocked_pass([long_])
    st.backfill_one(p, long_, p.idx.constraint(long_))
    assert p.decisions == []
    reason, message, _ = later_of(p)[3]
    assert reason is Reason.RESERVED_FOR_HIGHER
    assert "it would delay job 1" in message


def test_backfill_stops_at_its_test_budget():
    jobs = [pending(2, planned=7200.0), pending(3, planned=600.0)]
    p = blocked_pass(jobs, backfill_max_tested=1)
    st.backfill(p, jobs)
    assert p.tested == 1 and p.stop_reason == STOP_BACKFILL_MAX_TESTED
    assert later_of(p)[3][0] is Reason.NOT_TESTED
    assert p.decisions == []  # job 3 would have fitted: it was never tried


def test_backfill_off_leaves_later_jobs_waiting_on_priority():
    jobs = [pending(2, planned=600.0)]
    p = blocked_pass(jobs, backfill=False)
    st.backfill(p, jobs)
    assert p.stop_reason == STOP_BACKFILL_OFF and p.tested == 0
    reason, message, _ = later_of(p)[2]
    assert reason is Reason.PRIORITY and "backfill is off" in message


# ------------------------------------------------------------------ reasons


def test_render_waits_one_wait_per_job_in_order_with_breakdown_and_refusal():
    jobs = [pending(1, gpus=2), pending(2, gpus=2)]
    p = make(cluster(node_gpus(1, 2), jobs, run=[running(7, (100,))]))
    st.ordering(p)
    p.wait(jobs[1], Reason.PRIORITY, "second", resources=None)
    p.wait(jobs[0], Reason.RESOURCES, "; first", 5.0, resources=(
        p.idx.constraint(jobs[0]), 2))  # fmt: skip
    p.refusals[2] = "; refused"
    st.render_waits(p)
    ws = waits(p.decisions)
    assert [(w.job_id, w.position) for w in p.decisions] == [(2, 1), (1, 2)]
    assert ws[2].message == "second; refused"
    assert ws[1].message.endswith("; first") and ws[1].message != "; first"
    assert ws[1].est_start == 5.0
    assert ws[1].breakdown is p.breakdowns[1]
    assert starts(p.decisions) == {}
