"""Reasons (the reasons stage): one per waiting job, with numbers a person can act on."""

from __future__ import annotations

import pytest

from scheduler.policy import Wait, decide
from scheduler.policy.reasons import duration
from tests.scheduler.test_policy_support import (
    cluster,
    node_gpus,
    pending,
    running,
    waits,
)


def test_the_waits_decide_builds_fast_are_ordinary_frozen_waits():
    [fast] = decide(cluster(node_gpus(1, 1, busy=(0,)), [pending(1)]))
    built = Wait(
        fast.job_id,
        fast.reason,
        fast.message,
        fast.position,
        dict(fast.breakdown),
        fast.est_start,
    )
    assert type(fast) is Wait
    assert fast == built
    assert repr(fast) == repr(built)
    with pytest.raises(AttributeError):
        fast.job_id = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (59, "59s"),
        (60, "1m"),
        (3599, "59m"),
        (3600, "1h 00m"),
        (3 * 86400 + 7200, "3d 2h"),
        (-5, "0s"),
    ],
)
def test_durations_read_well(seconds, text):
    assert duration(seconds) == text


def test_volcano_style_histogram_names_every_refused_node():
    gpus = (
        node_gpus(1, 2, model="NVIDIA K80")
        + node_gpus(2, 4, model="NVIDIA A100-40GB", mem=40960)
        + node_gpus(3, 2, model="NVIDIA A100-80GB")
        + node_gpus(4, 4, model="NVIDIA A100-80GB", busy=(0, 1))
    )
    run = [running(9, (400, 401), ends_in=600)]
    w = waits(decide(cluster(gpus, [pending(1, 3, model="a100", mem=80000)], run=run)))[
        1
    ]
    assert w.message.startswith(
        "waiting for 3 GPUs (model ~'a100', >= 80000 MiB) on one node;"
        " at most 2 free on one node now"
        " (0/4 nodes fit: 1 model mismatch, 1 too little GPU memory,"
        " 1 too few GPUs, 1 too few free GPUs)"
    )
    assert "in 10m" in w.message and "job 9" in w.message


def test_positions_follow_the_scheduling_order_and_skip_started_jobs():
    jobs = [pending(1, 1, cls="high"), pending(2, 2), pending(3, 1, cls="best-effort")]
    ds = decide(cluster(node_gpus(1, 1), jobs))
    ws = waits(ds)
    assert [ws[2].position, ws[3].position] == [1, 2]
