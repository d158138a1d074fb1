"""Job arrays' run-at-once limit and dependencies in the pure policy (issue 8:
``scheduler/policy/arrays.py``, ``scheduler/policy/dependency.py``), for every
policy: production and the simulator run the same gate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.policy import Dependency, Preempt, Reason, decide
from scheduler.policy.dependency import met
from tests.scheduler.test_policy_support import (
    cluster,
    node_gpus,
    pending,
    running,
    starts,
    waits,
)

POLICIES = ["gpulab", "slurm", "fifo"]


def task(job_id: int, array: int = 7, limit: int | None = 2, **kw: object):
    return replace(pending(job_id, **kw), array_id=array, array_limit=limit)  # type: ignore[arg-type]


def run_task(job_id: int, gpu: int, array: int = 7):
    return replace(running(job_id, (gpu,)), array_id=array)


# ------------------------------------------------------------------ arrays


@pytest.mark.parametrize("policy", POLICIES)
def test_it_starts_at_most_the_limit_of_an_array_in_one_pass(policy: str) -> None:
    state = cluster(node_gpus(1, 8), [task(i) for i in range(1, 6)], name=policy)
    decisions = decide(state)
    assert sorted(starts(decisions)) == [1, 2]
    left = waits(decisions)
    assert {left[i].reason for i in (3, 4, 5)} == {Reason.ARRAY_LIMIT}
    assert "at most 2 task(s) at once (%2) and 2 run now" in left[3].message


@pytest.mark.parametrize("policy", POLICIES)
def test_it_counts_running_tasks_against_the_limit(policy: str) -> None:
    state = cluster(
        node_gpus(1, 8),
        [task(3), task(4)],
        run=[run_task(1, 0)],
        name=policy,
    )
    decisions = decide(state)
    assert list(starts(decisions)) == [3]
    assert waits(decisions)[4].reason == Reason.ARRAY_LIMIT


@pytest.mark.parametrize("policy", POLICIES)
def test_a_task_being_stopped_still_counts(policy: str) -> None:
    stopping = replace(run_task(1, 0), stopping=True)
    state = cluster(node_gpus(1, 8), [task(3, limit=1)], run=[stopping], name=policy)
    assert waits(decide(state))[3].reason == Reason.ARRAY_LIMIT


@pytest.mark.parametrize("policy", POLICIES)
def test_limits_are_per_array_and_other_jobs_are_untouched(policy: str) -> None:
    jobs = [
        task(1, array=7, limit=1),
        task(2, array=7, limit=1),
        task(3, array=8, limit=1),
        pending(4),
        task(5, array=9, limit=None),
        task(6, array=9, limit=None),
    ]
    decisions = decide(cluster(node_gpus(1, 8), jobs, name=policy))
    assert sorted(starts(decisions)) == [1, 3, 4, 5, 6]
    assert waits(decisions)[2].reason == Reason.ARRAY_LIMIT


def test_a_task_held_by_its_limit_reserves_and_preempts_nothing() -> None:
    """The limited task ranks first (high class) but is gated before placement:
    the next job starts on the free GPU and no best-effort job is preempted."""
    gpus = node_gpus(1, 3)
    be = running(9, (gpus[0].id,), cls="best-effort")
    jobs = [task(1, limit=1, cls="high"), pending(2, age=10)]
    state = cluster(gpus, jobs, run=[be, run_task(8, gpus[1].id)])
    decisions = decide(state)
    assert not [d for d in decisions if isinstance(d, Preempt)]
    assert waits(decisions)[1].reason == Reason.ARRAY_LIMIT
    assert starts(decisions)[2].gpu_ids == (gpus[2].id,)


# ------------------------------------------------------------------ dependencies


@pytest.mark.parametrize(
    ("kind", "status", "outcome"),
    [
        ("afterok", "completed", "met"),
        ("afterok", "failed", "never"),
        ("afterok", "cancelled", "never"),
        ("afterok", "timeout", "never"),
        ("afterok", "running", "not yet"),
        ("afterok", "pending", "not yet"),
        ("afterok", "held", "not yet"),
        ("afternotok", "completed", "never"),
        ("afternotok", "failed", "met"),
        ("afternotok", "cancelled", "met"),
        ("afternotok", "timeout", "met"),
        ("afternotok", "starting", "not yet"),
        ("afterany", "completed", "met"),
        ("afterany", "failed", "met"),
        ("afterany", "cancelled", "met"),
        ("afterany", "timeout", "met"),
        ("afterany", "running", "not yet"),
        ("afterany", "preempted", "not yet"),
    ],
)
def test_when_a_dependency_is_met(kind: str, status: str, outcome: str) -> None:
    expected = {"met": True, "never": False, "not yet": None}[outcome]
    assert met(Dependency(kind, 5, status)) is expected


def with_deps(job_id: int, *deps: Dependency, **kw: object):
    return replace(pending(job_id, **kw), dependencies=deps)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
def test_it_waits_for_a_dependency_that_has_not_ended(policy: str) -> None:
    job = with_deps(2, Dependency("afterok", 1, "running"))
    decisions = decide(cluster(node_gpus(1, 4), [job], name=policy))
    wait = waits(decisions)[2]
    assert wait.reason == Reason.DEPENDENCY
    assert wait.message == "waiting for job 1 (running) to end (afterok)"


@pytest.mark.parametrize("policy", POLICIES)
def test_it_starts_once_every_dependency_is_met(policy: str) -> None:
    job = with_deps(
        3,
        Dependency("afterok", 1, "completed", 0),
        Dependency("afternotok", 2, "failed", 1),
    )
    assert list(starts(decide(cluster(node_gpus(1, 4), [job], name=policy)))) == [3]


@pytest.mark.parametrize("policy", POLICIES)
def test_one_unmet_dependency_of_several_keeps_it_waiting(policy: str) -> None:
    job = with_deps(
        4,
        Dependency("afterany", 1, "completed", 0),
        Dependency("afterany", 2, "pending"),
        Dependency("afterok", 3, "held"),
    )
    wait = waits(decide(cluster(node_gpus(1, 4), [job], name=policy)))[4]
    assert wait.reason == Reason.DEPENDENCY
    assert wait.message == "waiting for job 2 (pending) and 1 more to end (afterany)"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("dep", "text"),
    [
        (Dependency("afterok", 1, "failed", 3), "job 1 failed (exit 3)"),
        (Dependency("afterok", 1, "cancelled"), "job 1 was cancelled"),
        (Dependency("afternotok", 1, "completed", 0), "job 1 completed (exit 0)"),
    ],
)
def test_a_dependency_that_can_never_be_met_is_named(
    policy: str, dep: Dependency, text: str
) -> None:
    job = with_deps(2, Dependency("afterany", 9, "running"), dep)
    wait = waits(decide(cluster(node_gpus(1, 4), [job], name=policy)))[2]
    assert wait.reason == Reason.DEPENDENCY_NEVER
    assert wait.message == (
        f"can never start: {text} and this job runs after it with {dep.kind}; cancel it"
    )


def test_a_job_waiting_on_a_dependency_blocks_nobody() -> None:
    """A high-class job waiting for its dependency is not the top blocked job:
    a later job takes the only free GPU and no preemption is planned for it."""
    first = with_deps(1, Dependency("afterok", 9, "running"), cls="high", gpus=2)
    gpus = node_gpus(1, 2)
    state = cluster(
        gpus, [first, pending(2)], run=[running(9, (gpus[0].id,), cls="best-effort")]
    )
    decisions = decide(state)
    assert list(starts(decisions)) == [2]
    assert not [d for d in decisions if isinstance(d, Preempt)]
