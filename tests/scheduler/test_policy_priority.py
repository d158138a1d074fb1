"""Multifactor priority and ordering (the ordering stage): pure, table-driven."""

from __future__ import annotations

import pytest

from scheduler.policy import PolicyConfig, Reason, Usage, decide
from scheduler.policy.fairshare import FairShare, factor
from scheduler.policy.priority import age_factor, size_factor
from tests.scheduler.test_policy_support import (
    GPULAB,
    SLURM,
    cluster,
    node_gpus,
    pending,
    starts,
    waits,
)

DAY = 86400.0
MAX_AGE = GPULAB.max_age_s


def order_of(state):
    """Job ids in scheduling order (every job waits: the cluster has no free GPU)."""
    ws = sorted(waits(decide(state)).values(), key=lambda w: w.position)
    return [w.job_id for w in ws]


def full():
    return node_gpus(1, 1, busy=(0,))


@pytest.mark.parametrize(
    ("age", "expected"),
    [
        (0.0, 0.0),
        (MAX_AGE / 2, 0.5),
        (MAX_AGE, 1.0),
        (MAX_AGE * 10, 1.0),  # saturates
        (-60.0, 0.0),  # a clock skew never goes negative
    ],
)
def test_age_factor_saturates(age, expected):
    assert age_factor(1000.0 + age, 1000.0, MAX_AGE) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("old_cls", "new_cls", "crossing_days"),
    [
        # default weights: class 1000, age 500. A normal job (class 500) ties a new
        # high job (1000) when its age factor reaches 1: after max_age (7 days).
        ("normal", "high", 7.0),
        ("best-effort", "normal", 7.0),
    ],
)
def test_an_old_lower_class_job_outranks_new_higher_ones_after_the_crossing_time(
    old_cls, new_cls, crossing_days
):
    def first(age_days):
        s = cluster(
            full(),
            [pending(1, cls=old_cls, age=age_days * DAY), pending(2, cls=new_cls)],
        )
        return order_of(s)[0]

    assert first(crossing_days - 0.01) == 2
    # at the crossing the priorities tie and the older goes first; past it, it leads
    assert first(crossing_days) == 1
    assert first(crossing_days * 3) == 1


def test_best_effort_never_passes_high_on_age_alone():
    s = cluster(
        full(), [pending(1, cls="best-effort", age=365 * DAY), pending(2, cls="high")]
    )
    assert order_of(s) == [2, 1]


@pytest.mark.parametrize(
    ("u", "s", "expected"),
    [
        (0.0, 0.5, 1.0),  # no usage: 1
        (0.5, 0.5, 0.5),  # at its share: 1/2
        (1.0, 0.5, 0.25),
        (0.25, 0.5, 2**-0.5),
        (0.0, 0.0, 1.0),  # zero shares, no usage
        (0.3, 0.0, 0.0),  # zero shares with usage: 2^-inf
    ],
)
def test_fairshare_factor(u, s, expected):
    assert factor(u, s) == pytest.approx(expected)


def test_fairshare_normalises_usage_and_shares_to_the_cluster():
    usage = Usage(
        group_usage={"heavy": 300.0, "light": 100.0},
        group_shares={"heavy": 1.0, "light": 1.0},
    )
    fs = FairShare(usage, {"heavy", "light"}, set())
    assert fs.group_norm("heavy") == pytest.approx((0.75, 0.5))
    assert fs.group_factor("heavy") == pytest.approx(2**-1.5)
    assert fs.group_factor("light") == pytest.approx(2**-0.5)
    assert fs.over_share("heavy")
    assert not fs.over_share("light")
    # a group nobody has heard of has no usage: factor 1
    assert fs.group_factor("new") == 1.0


def test_fair_share_moves_a_heavy_groups_job_behind_a_light_groups_job():
    usage = Usage(group_usage={"heavy": 900.0, "light": 100.0})
    jobs = [pending(1, group="heavy", age=3600), pending(2, group="light")]
    assert order_of(cluster(full(), jobs, usage=usage)) == [2, 1]
    # without usage, the older job goes first
    assert order_of(cluster(full(), jobs)) == [1, 2]


def test_user_fair_share_within_a_group_orders_its_members():
    usage = Usage(
        group_usage={"g": 1000.0},
        user_usage={("g", "alice"): 900.0, ("g", "bob"): 100.0},
    )
    jobs = [pending(1, user="alice", age=3600), pending(2, user="bob")]
    assert order_of(cluster(full(), jobs, usage=usage)) == [2, 1]


def test_the_group_factor_is_primary_over_the_user_factor():
    # bob is light within a heavy group; carol is heavy within a light group.
    usage = Usage(
        group_usage={"heavy": 900.0, "light": 100.0},
        user_usage={
            ("heavy", "bob"): 0.0,
            ("heavy", "dave"): 900.0,
            ("light", "carol"): 100.0,
        },
    )
    jobs = [
        pending(1, group="heavy", user="bob", age=60),
        pending(2, group="light", user="carol"),
    ]
    fs = FairShare(usage, {"heavy", "light"}, {("heavy", "bob"), ("light", "carol")})
    assert fs.of("heavy", "bob") < fs.of("light", "carol")
    assert order_of(cluster(full(), jobs, usage=usage)) == [2, 1]


@pytest.mark.parametrize(
    ("gpus", "total", "expected"),
    [(1, 8, 0.125), (8, 8, 1.0), (16, 8, 1.0), (1, 0, 0.0)],
)
def test_size_factor_favours_larger_jobs(gpus, total, expected):
    assert size_factor(gpus, total) == pytest.approx(expected)


def test_a_larger_job_goes_first_when_all_else_is_equal():
    s = cluster(node_gpus(1, 4, busy=(0, 1, 2, 3)), [pending(1, 1), pending(2, 4)])
    assert order_of(s) == [2, 1]


@pytest.mark.parametrize("config", [GPULAB, SLURM])
def test_breakdown_is_on_every_wait_and_sums_to_the_priority(config):
    usage = Usage(group_usage={"a": 10.0, "b": 30.0})
    jobs = [
        pending(
            i,
            1 + i % 3,
            cls=("high", "normal", "best-effort")[i % 3],
            age=i * 3600.0,
            group="ab"[i % 2],
        )
        for i in range(1, 30)
    ]
    ds = decide(cluster(node_gpus(1, 4), jobs, config=config, usage=usage))
    ws = waits(ds)
    assert len(ws) + len(starts(ds)) == len(jobs)
    prios = []
    factors = {"class", "age", "fairshare", "size"}
    if config.name == "gpulab":
        factors.add("runtime")  # Slurm has no run-time factor
    for w in sorted(ws.values(), key=lambda w: w.position):
        assert set(w.breakdown) == factors
        assert all(v >= 0 for v in w.breakdown.values())
        prios.append(sum(w.breakdown.values()))
    # the waits come in scheduling order: priority never increases
    assert prios == sorted(prios, reverse=True)


def test_weights_are_settings():
    jobs = [pending(1, cls="high"), pending(2, cls="normal", age=3600)]
    only_age = PolicyConfig(name="gpulab", weight_class=0.0)
    assert order_of(cluster(full(), jobs)) == [1, 2]
    assert order_of(cluster(full(), jobs, config=only_age)) == [2, 1]
    w = waits(decide(cluster(full(), jobs, config=only_age)))[1]
    assert w.breakdown["class"] == 0.0


def test_order_is_stable_priority_then_submit_then_id():
    jobs = [pending(3, age=10), pending(2, age=10), pending(1, age=5)]
    assert order_of(cluster(full(), jobs)) == [2, 3, 1]


def test_a_shape_no_node_can_hold_is_refused_at_the_gate():
    s = cluster(node_gpus(1, 4), [pending(1, 9), pending(2, mem=10**6)])
    ws = waits(decide(s))
    assert ws[1].reason is Reason.NO_SUCH_SHAPE
    assert "the largest node has 4" in ws[1].message
    assert ws[2].reason is Reason.NO_SUCH_SHAPE


def test_the_batch_breakdowns_equal_the_single_job_breakdown():
    from scheduler.policy.priority import breakdown, breakdowns
    from tests.scheduler.test_policy_support import CLASSES, NOW

    usage = Usage(group_usage={"a": 5.0, "b": 1.0}, user_usage={("a", "x"): 5.0})
    jobs = [
        pending(
            i,
            1 + i % 4,
            cls=("high", "normal", "best-effort")[i % 3],
            age=i * 50_000.0,
            group="ab"[i % 2],
            user="xy"[i % 3 % 2],
        )
        for i in range(1, 25)
    ]
    fs = FairShare(usage, {"a", "b"}, {(j.group, j.user) for j in jobs})
    kw = {
        "now": NOW,
        "config": GPULAB,
        "classes": CLASSES,
        "fairshare": fs,
        "total_gpus": 16,
    }
    many, prio = breakdowns(jobs, **kw)
    for j in jobs:
        one = breakdown(j, **kw)
        assert many[j.id] == pytest.approx(one)
        assert prio[j.id] == pytest.approx(sum(one.values()))


ALICE = 2**-1.8  # 90 % of her group's use on half of its shares: 2^(-0.9 / 0.5)


@pytest.mark.parametrize(
    ("weight", "expected"),
    [
        (1.0, 0.5 * (1 + ALICE) / 2),  # the group's factor, moved by half at most
        (0.5, 0.5 * (1 - 0.5 * (1 - ALICE) / 2)),
        (0.0, 0.5),  # the group's factor alone
        (-1.0, 0.5),  # out of range: clamped to 0..1
        (2.0, 0.5 * (1 + ALICE) / 2),
    ],
)
def test_the_users_part_of_fair_share_has_a_weight(weight, expected):
    """Group g used half of the cluster's GPU time on half of the shares (2^-1);
    alice 90 % of g's on half of g's shares."""
    usage = Usage(
        group_usage={"g": 100.0, "other": 100.0},
        user_usage={("g", "alice"): 90.0, ("g", "bob"): 10.0},
    )
    users = {("g", "alice"), ("g", "bob")}
    fs = FairShare(usage, {"g", "other"}, users, user_weight=weight)
    assert fs.group_factor("g") == pytest.approx(0.5)
    assert fs.user_factor("g", "alice") == pytest.approx(ALICE)
    assert fs.of("g", "alice") == pytest.approx(expected)


def test_without_the_users_part_groups_still_compete_and_members_go_by_age():
    """``fairshare_user`` 0: alice's heavy use no longer puts her older job behind
    bob's, a heavy group's job still goes behind a light group's, and ``slurm``
    keeps weighing users whatever the setting (Slurm's multifactor does)."""
    usage = Usage(
        group_usage={"g": 1000.0, "light": 10.0},
        user_usage={("g", "alice"): 900.0, ("g", "bob"): 100.0},
    )
    jobs = [pending(1, user="alice", age=3600), pending(2, user="bob")]
    groups_only = PolicyConfig(name="gpulab", fairshare_user=0.0)
    assert order_of(cluster(full(), jobs, usage=usage)) == [2, 1]
    assert order_of(cluster(full(), jobs, usage=usage, config=groups_only)) == [1, 2]
    slurm = PolicyConfig(name="slurm", fairshare_user=0.0)
    assert order_of(cluster(full(), jobs, usage=usage, config=slurm)) == [2, 1]
    heavy_light = [pending(1, group="g", age=3600), pending(2, group="light")]
    got = order_of(cluster(full(), heavy_light, usage=usage, config=groups_only))
    assert got == [2, 1]
