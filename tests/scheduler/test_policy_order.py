"""``stages.scheduling_order`` (the ordering stage's sort) against a straightforward
reference: the tuple sort it replaced, kept here. The fast sort orders by priority
alone and sorts only the runs of equal priority by the rest of the key; these
tests draw instances full of such runs (few distinct priorities, class parts and
submit times, ``0.0`` beside ``-0.0``, interactive jobs, NaN) and require the very
same order, then the same decisions from whole passes."""

from __future__ import annotations

import math
import random

import pytest

from scheduler.policy import (
    DEFAULT_CLASSES,
    ClusterState,
    NodeView,
    PendingJob,
    PolicyConfig,
    RunningJob,
    Start,
    Usage,
    Wait,
    decide,
)
from scheduler.policy import stages as st
from tests.scheduler.test_policy_support import node_gpus

NOW = 2_000_000.0


def reference_order(pending, prio, class_part, interactive):
    """The scheduling order by definition: sort the tuples (not interactive,
    -priority, -class part, submitted, id, position)."""
    keyed = sorted(
        (
            j.priority_class not in interactive,
            -prio[i],
            -class_part(j) if class_part is not None else 0.0,
            j.submitted_at,
            j.id,
            i,
        )
        for i, j in enumerate(pending)
    )
    return [pending[k[5]] for k in keyed]


def jobs(rng: random.Random, n: int) -> list[PendingJob]:
    ids = rng.sample(range(1, 10 * n), n)
    return [
        PendingJob(
            id=ids[i],
            gpus=rng.choice((1, 2, 4)),
            gpu_memory_mib=None,
            priority_weight=0.5,
            submitted_at=NOW - rng.choice((0.0, 60.0, 3600.0)),
            priority_class=rng.choice(
                ("normal", "normal", "high", "best-effort", "interactive")
            ),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("with_class", [True, False])
def test_the_fast_sort_gives_the_reference_order(seed, with_class):
    rng = random.Random(seed)
    pending = jobs(rng, 600)
    # few distinct priorities: long runs of ties, and 0.0 beside -0.0
    prio = [rng.choice((0.0, -0.0, 1.5, 700.25, 700.25, 1e-9)) for _ in pending]
    parts = {j.id: rng.choice((0.0, 500.0, 1000.0)) for j in pending}
    class_part = (lambda j: parts[j.id]) if with_class else None
    interactive = {"interactive"} if seed % 2 else set()
    got = st.scheduling_order(pending, prio, class_part, interactive)
    want = reference_order(pending, prio, class_part, interactive)
    assert [j.id for j in got] == [j.id for j in want]


def test_distinct_priorities_and_no_interactive_jobs_give_the_reference_order():
    rng = random.Random(7)
    pending = [j for j in jobs(rng, 2000) if j.priority_class != "interactive"]
    prio = [rng.uniform(0, 3000) for _ in pending]
    got = st.scheduling_order(pending, prio, None, {"interactive"})
    assert got == reference_order(pending, prio, None, {"interactive"})


def test_a_nan_priority_falls_back_to_the_reference_sort():
    rng = random.Random(3)
    pending = jobs(rng, 200)
    prio = [math.nan if i % 17 == 0 else rng.choice((1.0, 2.0)) for i in range(200)]
    got = st.scheduling_order(pending, prio, None, {"interactive"})
    assert got == reference_order(pending, prio, None, {"interactive"})


def cluster(seed: int, name: str) -> ClusterState:
    """A large-ish random pass: 16 nodes of 8 GPUs, some busy with checkpointable
    jobs that have attained service, 1,500 waiting jobs of a few users, sizes,
    classes and submit times (ties in priority), some resumed after a preemption."""
    rng = random.Random(seed)
    gpus = []
    running = []
    for n in range(16):
        busy = tuple(i for i in range(8) if rng.random() < 0.6)
        gpus += node_gpus(n, 8, busy=busy)
        for i in busy:
            running.append(
                RunningJob(
                    10_000 + n * 100 + i,
                    (n * 100 + i,),
                    NOW - rng.choice((300.0, 4000.0, 90_000.0)),
                    rng.choice((600.0, 86400.0)),
                    86400.0,
                    user=f"u{rng.randrange(4)}",
                    group=f"g{rng.randrange(3)}",
                    checkpointable=rng.random() < 0.5,
                    prior_gpu_s=rng.choice((0.0, 20 * 3600.0, 80 * 3600.0)),
                )
            )
    pending = []
    for i in range(1500):
        resumed = rng.random() < 0.1
        pending.append(
            PendingJob(
                id=i + 1,
                gpus=rng.choice((1, 1, 2, 4, 8, 16)),
                gpu_memory_mib=None,
                priority_weight=0.5,
                submitted_at=NOW - rng.choice((0.0, 600.0, 86400.0, 9 * 86400.0)),
                user=f"u{rng.randrange(4)}",
                group=f"g{rng.randrange(3)}",
                priority_class=rng.choice(("normal", "high", "best-effort")),
                planned_s=rng.choice((600.0, 3600.0, 86400.0)),
                checkpointable=resumed or rng.random() < 0.3,
                attained_gpu_s=rng.choice((0.0, 30 * 3600.0)) if resumed else 0.0,
                preempted_at=NOW - 1200.0 if resumed else None,
            )
        )
    return ClusterState(
        now=NOW,
        nodes=tuple(NodeView(n, f"node{n:02d}") for n in range(16)),
        gpus=tuple(gpus),
        pending=tuple(pending),
        running=tuple(running),
        usage=Usage(group_usage={"g0": 5e5, "g1": 1e5}),
        classes=DEFAULT_CLASSES,
        config=PolicyConfig(name=name, backfill_max_tested=300),
    )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["gpulab", "slurm"])
def test_a_whole_pass_orders_and_decides_as_the_reference_order(seed, name):
    state = cluster(seed, name)
    gpulab = name == "gpulab"
    p = st.Pass(
        state, preemption=gpulab, topology=gpulab, predictions=False, runtime=gpulab
    )
    order = st.ordering(p)
    base = reference_order(
        state.pending,
        [p.prio[j.id] for j in state.pending],
        (lambda j: p.breakdowns[j.id]["class"]) if gpulab else None,
        {"interactive"},
    )
    if gpulab:
        base = st.preempt.las_order(p, base)
        base = st.wait_bound.bound_order(
            base,
            state.now,
            state.config.max_wait_s,
            lambda j: p.breakdowns[j.id]["class"],
            {"interactive"},
        )
    assert [j.id for j in order] == [j.id for j in base]
    # ties are there to break: many jobs share their priority with another
    assert len(set(p.prio.values())) < len(state.pending)
    # and the pass's waits follow that order, numbered from 1
    decisions = decide(state)
    started = {d.job_id for d in decisions if isinstance(d, Start)}
    waits = [d for d in decisions if isinstance(d, Wait)]
    assert started and waits
    assert [w.job_id for w in waits] == [j.id for j in order if j.id not in started]
    assert [w.position for w in waits] == list(range(1, len(waits) + 1))
