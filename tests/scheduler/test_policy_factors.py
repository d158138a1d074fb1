"""Each priority factor pinned to its value: the weighted parts a waiting job's
breakdown shows, computed here by hand from the documented formulas (not by the
policy's own functions), so a changed formula fails even when the order it gives
stays the same. Both paths are checked: the pass (``decide``'s ``Wait``
breakdowns, built by ``priority.breakdowns``) and ``priority.breakdown``."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from scheduler.policy import ClassSpec, Usage, Wait, decide
from scheduler.policy.fairshare import FairShare
from scheduler.policy.priority import breakdown
from tests.scheduler.test_policy_support import (
    GPULAB,
    NOW,
    SLURM,
    cluster,
    node_gpus,
    pending,
)

DAY = 86400.0
FULL = node_gpus(1, 8, busy=tuple(range(8)))  # 8 GPUs, none free: every job waits


def via_pass(state, job_id):
    (w,) = [d for d in decide(state) if isinstance(d, Wait) and d.job_id == job_id]
    return dict(w.breakdown)


def via_breakdown(state, job_id):
    job = next(j for j in state.pending if j.id == job_id)
    fs = FairShare(
        state.usage,
        {j.group for j in state.pending},
        {(j.group, j.user) for j in state.pending},
    )
    cfg = state.config
    return breakdown(
        job,
        now=state.now,
        config=cfg,
        classes=state.classes,
        fairshare=fs,
        total_gpus=len(state.gpus),
        runtime=cfg.name == "gpulab",
    )


PATHS = pytest.mark.parametrize("parts", [via_pass, via_breakdown])


@PATHS
@pytest.mark.parametrize(
    ("cls", "weight", "expected"),
    [
        ("high", None, 1000.0),  # weight_class x ClassSpec.weight 1.0
        ("normal", None, 500.0),
        ("best-effort", None, 0.0),
        ("custom", 0.3, 300.0),  # no such class: the job's own priority_weight
        ("over", None, 1000.0),  # a class weight of 1.7 is clamped to 1
    ],
)
def test_class_factor(parts, cls, weight, expected):
    job = pending(1, cls=cls)
    if weight is not None:
        job = replace(job, priority_weight=weight)
    s = cluster(FULL, [job], config=SLURM)
    s = replace(s, classes={**s.classes, "over": ClassSpec("over", 1.7)})
    assert parts(s, 1)["class"] == pytest.approx(expected, abs=1e-9)


@PATHS
@pytest.mark.parametrize(
    ("age", "expected"),
    [
        (0.0, 0.0),
        (DAY, 500.0 / 7.0),  # weight_age x age / max_age_s (7 days)
        (3.5 * DAY, 250.0),
        (30 * DAY, 500.0),  # saturates at max_age_s
        (-DAY, 0.0),  # submitted "in the future": clamped to 0
    ],
)
def test_age_factor(parts, age, expected):
    s = cluster(FULL, [pending(1, age=age)], config=SLURM)
    assert parts(s, 1)["age"] == pytest.approx(expected, abs=1e-9)


@PATHS
@pytest.mark.parametrize(("gpus", "expected"), [(1, 12.5), (2, 25.0), (16, 100.0)])
def test_size_factor(parts, gpus, expected):
    """weight_size x gpus / all GPUs of the cluster (8), capped at 1."""
    s = cluster(FULL, [pending(1, gpus=gpus)], config=SLURM)
    assert parts(s, 1)["size"] == pytest.approx(expected, abs=1e-9)


USAGE = Usage(
    group_usage={"heavy": 300.0, "light": 100.0},
    user_usage={("heavy", "ann"): 200.0, ("heavy", "bob"): 100.0},
)


def fair_state():
    jobs = [
        pending(1, group="heavy", user="ann"),
        pending(2, group="heavy", user="bob"),
        pending(3, group="light", user="cy"),
        pending(4, group="new", user="dee"),
    ]
    return cluster(FULL, jobs, config=SLURM, usage=USAGE)


# Group "heavy": U = 300 / 400, S = 1 / 3 (three groups of one share each).
F_HEAVY = 2.0 ** (-(300 / 400) / (1 / 3))
# Within it, ann: U = 200 / 300, S = 1 / 2; bob: U = 100 / 300, S = 1 / 2.
F_ANN = 2.0 ** (-(200 / 300) / (1 / 2))
F_BOB = 2.0 ** (-(100 / 300) / (1 / 2))
F_LIGHT = 2.0 ** (-(100 / 400) / (1 / 3))


@PATHS
@pytest.mark.parametrize(
    ("job_id", "expected"),
    [
        # weight_fairshare x F_group x (1 + F_user) / 2
        (1, 1000.0 * F_HEAVY * (1.0 + F_ANN) / 2.0),
        (2, 1000.0 * F_HEAVY * (1.0 + F_BOB) / 2.0),
        # cy has no usage of their own: F_user = 1, so F = F_group
        (3, 1000.0 * F_LIGHT),
        (4, 1000.0),  # a group with no usage: factor 1
    ],
)
def test_fairshare_factor(parts, job_id, expected):
    assert parts(fair_state(), job_id)["fairshare"] == pytest.approx(
        expected, rel=1e-12
    )


def test_the_fairshare_values_are_not_trivial():
    """The formula's two terms both matter for ann: other combinations of the
    same factors differ from the pinned value by far more than the tolerance."""
    pinned = F_HEAVY * (1.0 + F_ANN) / 2.0
    for other in (F_HEAVY * F_ANN, (F_HEAVY + F_ANN) / 2.0, F_HEAVY, F_ANN):
        assert abs(other - pinned) > 0.01


def runtime_part(planned_s, ref_s=6 * 3600.0):
    """1 - ln(1 + planned / 60 s) / ln(1 + ref / 60 s), clamped to [0, 1]."""
    f = 1.0 - math.log(1.0 + planned_s / 60.0) / math.log(1.0 + ref_s / 60.0)
    return min(1.0, max(0.0, f))


@PATHS
@pytest.mark.parametrize(
    ("planned", "age", "expected"),
    [
        (3600.0, 0.0, 500.0 * runtime_part(3600.0)),  # about 0.30: 151.2
        (60.0, 0.0, 500.0 * runtime_part(60.0)),
        (6 * 3600.0, 0.0, 0.0),  # at runtime_ref_s and beyond: 0
        (3 * DAY, 0.0, 0.0),
        # a head start that age takes over: x (1 - age factor)
        (3600.0, 3.5 * DAY, 500.0 * runtime_part(3600.0) * 0.5),
        # at max_age_s the whole weight, as if it were the shortest job
        (3 * DAY, 7 * DAY, 500.0),
    ],
)
def test_runtime_factor(parts, planned, age, expected):
    s = cluster(FULL, [pending(1, planned=planned, age=age)], config=GPULAB)
    assert parts(s, 1)["runtime"] == pytest.approx(expected, abs=1e-9)


def test_runtime_values_by_hand():
    """The documented points of the log scale (priority.runtime_factor)."""
    assert runtime_part(3600.0) == pytest.approx(0.3019, abs=1e-4)
    assert runtime_part(60.0) == pytest.approx(0.8823, abs=1e-4)


@PATHS
def test_slurm_has_no_runtime_factor_and_the_priority_is_the_sum(parts):
    s = cluster(FULL, [pending(1, cls="high", age=DAY, gpus=2)], config=SLURM)
    got = parts(s, 1)
    assert got == pytest.approx(
        {"class": 1000.0, "age": 500.0 / 7.0, "fairshare": 1000.0, "size": 25.0}
    )


def test_the_weights_scale_each_part():
    s = cluster(
        FULL,
        [pending(1, cls="normal", age=DAY, gpus=2, planned=3600.0)],
        weight_class=10.0,
        weight_age=20.0,
        weight_fairshare=30.0,
        weight_size=40.0,
        weight_runtime=50.0,
    )
    x = 1.0 / 7.0
    assert via_pass(s, 1) == pytest.approx(
        {
            "class": 10.0 * 0.5,
            "age": 20.0 * x,
            "fairshare": 30.0,
            "size": 40.0 * 0.25,
            "runtime": 50.0 * runtime_part(3600.0) * (1.0 - x),
        }
    )
    assert NOW - s.pending[0].submitted_at == DAY
