"""Quotas in the pure policy (issue 6, ``scheduler/policy/quota.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.policy import (
    Preempt,
    QuotaStop,
    QuotaView,
    Reason,
    decide,
)
from tests.scheduler.test_policy_support import (
    NOW,
    cluster,
    node_gpus,
    pending,
    running,
    starts,
    waits,
)

RESET = NOW + 3 * 86400 + 7200  # 3 days 2 h from now


def quota(
    qid: int = 1,
    *,
    group: str = "",
    user: str = "",
    hard: bool = True,
    hours: float | None = None,
    used: float = 0.0,
    max_gpus: int | None = None,
    running_gpus: int = 0,
) -> QuotaView:
    return QuotaView(
        id=qid,
        group=group,
        user=user,
        hard=hard,
        gpu_hours=hours,
        used_gpu_hours=used,
        max_gpus=max_gpus,
        running_gpus=running_gpus,
        period="month",
        resets_at=RESET,
    )


def with_quotas(state, *quotas):
    return replace(state, quotas=tuple(quotas))


POLICIES = ["gpulab", "slurm", "fifo"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("case", "q", "job", "held"),
    [
        # GPU-hours
        ("hard, used up", quota(group="g", hours=10, used=10), pending(1), True),
        ("hard, over", quota(group="g", hours=10, used=12.5), pending(1), True),
        ("hard, under", quota(group="g", hours=10, used=9.9), pending(1), False),
        ("soft, used up", quota(group="g", hard=False, hours=10, used=20), pending(1),
         False),
        ("zero hours", quota(group="g", hours=0), pending(1), True),
        ("other group", quota(group="h", hours=10, used=20), pending(1), False),
        ("user quota, any group", quota(user="u", hours=1, used=1),
         pending(1, group="other"), True),
        ("another user", quota(user="v", hours=1, used=1), pending(1), False),
        # concurrent GPUs: running GPUs plus the job's own
        ("cap reached", quota(group="g", max_gpus=2, running_gpus=2), pending(1),
         True),
        ("cap passed by the job", quota(group="g", max_gpus=2, running_gpus=1),
         pending(1, 2), True),
        ("cap fits", quota(group="g", max_gpus=2, running_gpus=1), pending(1), False),
        ("soft quota's cap holds too", quota(group="g", hard=False, max_gpus=1,
         running_gpus=1), pending(1), True),
    ],
)  # fmt: skip
def test_it_holds_a_job_only_when_its_quota_says_so(policy, case, q, job, held):
    state = with_quotas(cluster(node_gpus(1, 4), [job], name=policy), q)
    ds = decide(state)
    if held:
        assert starts(ds) == {}, case
        [w] = waits(ds).values()
        assert w.reason is Reason.QUOTA, case
        assert w.message.startswith("quota exhausted: "), w.message
    else:
        assert set(starts(ds)) == {job.id}, case


def test_the_message_names_the_quota_its_use_and_the_reset():
    q = quota(group="g", hours=100, used=123.44)
    ds = decide(with_quotas(cluster(node_gpus(1, 2), [pending(1)]), q))
    message = waits(ds)[1].message
    assert "group g used 123.4 of its 100.0 GPU-hours this month (hard limit)" in (
        message
    )
    assert "resets at 1970-01-15 15:46 UTC (in 3d 2h)" in message


def test_the_cap_message_names_the_numbers():
    q = quota(user="u", max_gpus=4, running_gpus=3)
    ds = decide(with_quotas(cluster(node_gpus(1, 4), [pending(1, 2)]), q))
    assert waits(ds)[1].message == (
        "quota exhausted: user u may hold at most 4 GPUs at once; its jobs hold 3"
        " now and this job needs 2; it waits for some of them to end"
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_the_cap_counts_jobs_started_earlier_in_the_pass(policy):
    q = quota(group="g", max_gpus=2, running_gpus=0)
    jobs = [pending(1, age=300), pending(2, age=200), pending(3, age=100)]
    ds = decide(with_quotas(cluster(node_gpus(1, 4), jobs, name=policy), q))
    assert set(starts(ds)) == {1, 2}
    assert waits(ds)[3].reason is Reason.QUOTA


def test_the_cap_counts_only_the_jobs_under_the_quota():
    # group g's cap is 1 GPU; h's job starts beside g's
    q = quota(group="g", max_gpus=1)
    jobs = [pending(1, age=300), pending(2, group="h", age=200), pending(3, age=100)]
    ds = decide(with_quotas(cluster(node_gpus(1, 4), jobs), q))
    assert set(starts(ds)) == {1, 2}
    assert waits(ds)[3].reason is Reason.QUOTA


@pytest.mark.parametrize("policy", ["gpulab", "slurm"])
def test_a_held_job_reserves_nothing_so_lower_jobs_of_others_start(policy):
    # 2 GPUs, one busy for an hour. The top job (2 GPUs, much older) of a group
    # over its hard limit would hold the reservation and keep the long 1-GPU job of
    # another group from the free GPU; held by its quota, it holds nothing.
    run = [running(50, (101,), group="h", ends_in=3600)]
    jobs = [
        pending(1, 2, group="g", age=6 * 86400),
        pending(2, 1, group="h", planned=10 * 3600),
    ]
    state = cluster(node_gpus(1, 2), jobs, run=run, name=policy)
    without = decide(state)
    assert starts(without) == {}
    assert waits(without)[2].reason is Reason.RESERVED_FOR_HIGHER
    ds = decide(with_quotas(state, quota(group="g", hours=5, used=7)))
    assert set(starts(ds)) == {2}
    assert waits(ds)[1].reason is Reason.QUOTA
    assert waits(ds)[1].est_start is None


def test_a_held_job_preempts_nobody():
    run = [running(50, (100,), cls="best-effort", group="h")]
    state = cluster(node_gpus(1, 1), [pending(1, cls="high")], run=run)
    assert any(isinstance(d, Preempt) for d in decide(state))
    ds = decide(with_quotas(state, quota(group="g", hours=5, used=7)))
    assert not any(isinstance(d, Preempt) for d in ds)
    assert waits(ds)[1].reason is Reason.QUOTA


@pytest.mark.parametrize(
    ("hard", "used", "factor", "first"),
    [
        (False, 11.0, 0.5, 2),  # soft, over: g's fair share halved, h's job first
        (False, 9.0, 0.5, 1),  # soft, under: unchanged, g's older job first
        (True, 9.0, 0.5, 1),  # hard, under: unchanged
        (False, 11.0, 1.0, 1),  # a factor of 1 changes nothing
    ],
)
def test_a_soft_limit_exceeded_lowers_the_fairshare_factor(hard, used, factor, first):
    jobs = [pending(1, group="g", age=60), pending(2, group="h", age=0)]
    q = quota(group="g", hard=hard, hours=10, used=used)
    state = with_quotas(cluster(node_gpus(1, 1), jobs, quota_soft_factor=factor), q)
    ds = decide(state)
    assert set(starts(ds)) == {first}
    # no usage: a fair-share factor of 1 (weight 1000), times the soft factor
    # for g's job when its soft quota is used up
    [(waiting, w)] = waits(ds).items()
    lowered = waiting == 1 and not hard and used >= 10
    assert w.breakdown["fairshare"] == pytest.approx(
        1000.0 * (factor if lowered else 1)
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("overrun", "q", "stopped"),
    [
        ("stop", quota(group="g", hours=10, used=10), {50}),
        ("finish", quota(group="g", hours=10, used=10), set()),
        ("stop", quota(group="g", hard=False, hours=10, used=20), set()),
        ("stop", quota(group="g", hours=10, used=9), set()),
        ("stop", quota(group="g", max_gpus=1, running_gpus=2), set()),  # cap only
        ("stop", quota(user="u", hours=1, used=2), {50}),
    ],
)
def test_running_jobs_over_a_hard_limit_stop_only_with_overrun_stop(
    policy, overrun, q, stopped
):
    run = [running(50, (100,), group="g"), running(51, (101,), group="h", user="w")]
    state = with_quotas(
        cluster(node_gpus(1, 2), [], run=run, name=policy, quota_overrun=overrun),
        q,
    )
    got = [d for d in decide(state) if isinstance(d, QuotaStop)]
    assert {d.job_id for d in got} == stopped
    for d in got:
        assert d.reason.startswith("stopped: ")
        assert "GPU-hours this month (hard limit" in d.reason


def test_a_job_already_being_stopped_is_not_stopped_again():
    run = [replace(running(50, (100,), group="g"), stopping=True)]
    state = with_quotas(
        cluster(node_gpus(1, 1), [], run=run, quota_overrun="stop"),
        quota(group="g", hours=1, used=2),
    )
    assert not [d for d in decide(state) if isinstance(d, QuotaStop)]


@pytest.mark.parametrize("policy", POLICIES)
def test_without_quotas_the_decisions_are_unchanged(policy):
    jobs = [pending(i, 1 + i % 3, group=f"g{i % 2}", age=i) for i in range(1, 9)]
    state = cluster(node_gpus(1, 4) + node_gpus(2, 4), jobs, name=policy)
    assert decide(state) == decide(with_quotas(state))
