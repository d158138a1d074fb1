"""The pure policy: no database, table-driven."""

from __future__ import annotations

import pytest

from scheduler.policy import (
    ClusterState,
    GpuView,
    NodeView,
    PendingJob,
    Placement,
    PolicyConfig,
    Reason,
    Start,
    Wait,
    decide,
)

FIFO = PolicyConfig(name="fifo")


def gpus(node_id: int, count: int, *, mem: int = 16384, busy: tuple[int, ...] = ()):
    return tuple(
        GpuView(
            id=node_id * 100 + i,
            node_id=node_id,
            index=i,
            memory_total_mib=mem,
            slots=2,
            free_slots=0 if i in busy else 2,
        )
        for i in range(count)
    )


def job(
    job_id: int,
    n: int = 1,
    *,
    mem: int | None = None,
    weight: float = 0.5,
    at: float = 0.0,
):
    return PendingJob(job_id, n, mem, weight, at or float(job_id))


def state(nodes, gpu_views, pending) -> ClusterState:
    return ClusterState(
        now=1000.0,
        nodes=tuple(nodes),
        gpus=tuple(gpu_views),
        pending=tuple(pending),
        config=FIFO,
    )


def test_it_starts_a_job_on_free_gpus_lowest_index_first():
    s = state([NodeView(1, "a")], gpus(1, 4, busy=(0,)), [job(1, 2)])
    assert decide(s) == [Start(1, (Placement(1, (101, 102)),))]


def test_it_prefers_the_best_fitting_node():
    # node 1 has 4 free GPUs, node 2 has 1: a 1-GPU job goes to node 2.
    s = state([NodeView(1, "a"), NodeView(2, "b")], gpus(1, 4) + gpus(2, 1), [job(1)])
    assert decide(s) == [Start(1, (Placement(2, (200,)),))]


def test_it_never_takes_a_partly_used_gpu():
    busy = (
        GpuView(
            id=1, node_id=1, index=0, memory_total_mib=16384, slots=2, free_slots=1
        ),
    )
    decisions = decide(state([NodeView(1, "a")], busy, [job(7)]))
    assert decisions == [Wait(7, Reason.RESOURCES, decisions[0].message, 1)]


@pytest.mark.parametrize(
    ("pending", "expected_started"),
    [
        # higher class weight first, even if submitted later
        ([job(1, weight=0.5, at=1), job(2, weight=1.0, at=2)], [2]),
        # same weight: older first
        ([job(3, at=5), job(4, at=1)], [4]),
        # same weight and time: lower id first
        ([job(6, at=1), job(5, at=1)], [5]),
    ],
)
def test_it_orders_by_priority_then_age_then_id(pending, expected_started):
    s = state([NodeView(1, "a")], gpus(1, 1), pending)
    assert [d.job_id for d in decide(s) if isinstance(d, Start)] == expected_started


def test_a_job_no_node_can_hold_gets_no_such_shape():
    s = state([NodeView(1, "a")], gpus(1, 2), [job(1, 3)])
    [wait] = decide(s)
    assert isinstance(wait, Wait)
    assert wait.reason is Reason.NO_SUCH_SHAPE
    assert "3 GPUs across nodes" in wait.message and "the cluster 2" in wait.message


def test_memory_request_filters_gpus():
    s = state([NodeView(1, "a")], gpus(1, 2, mem=16384), [job(1, mem=20000)])
    [wait] = decide(s)
    assert wait.reason is Reason.NO_SUCH_SHAPE
    assert ">= 20000 MiB" in wait.message


def test_a_job_wider_than_every_node_starts_as_a_gang():
    s = state(
        [NodeView(1, "a"), NodeView(2, "b")],
        gpus(1, 2) + gpus(2, 2),
        [job(1, 3), job(2, 1)],
    )
    assert decide(s) == [
        Start(1, (Placement(1, (100, 101)), Placement(2, (200,)))),
        Start(2, (Placement(2, (201,)),)),
    ]


def test_unschedulable_nodes_and_gpus_are_not_used_but_count_as_capacity():
    lost = GpuView(
        id=1,
        node_id=1,
        index=0,
        memory_total_mib=16384,
        slots=1,
        free_slots=1,
        schedulable=False,
    )
    s = state(
        [NodeView(1, "a"), NodeView(2, "b", schedulable=False)],
        (lost, *gpus(2, 1)),
        [job(1)],
    )
    [wait] = decide(s)
    assert wait.reason is Reason.RESOURCES  # node b may come back


def test_a_gpu_is_never_given_twice_in_one_pass():
    s = state([NodeView(1, "a")], gpus(1, 3), [job(i) for i in range(1, 6)])
    taken = [g for d in decide(s) if isinstance(d, Start) for g in d.gpu_ids]
    assert sorted(taken) == [100, 101, 102]


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("policy", ["fifo", "slurm", "gpulab"])
def test_decide_pauses_the_collector_and_restores_it(enabled, policy, monkeypatch):
    """decide() runs with the cyclic GC off (speed) and leaves it as it found it,
    also when it raises."""
    import gc

    from scheduler import policy as policy_module

    seen = []
    real = policy_module._run

    def spy(state):
        seen.append(gc.isenabled())
        return real(state)

    monkeypatch.setattr(policy_module, "_run", spy)
    (gc.enable if enabled else gc.disable)()
    try:
        state = ClusterState(
            now=0.0,
            nodes=(NodeView(1, "n1"),),
            gpus=gpus(1, 1),
            pending=(job(1),),
            config=PolicyConfig(name=policy),
        )
        assert isinstance(decide(state)[0], Start)
        assert gc.isenabled() is enabled
        with pytest.raises(ValueError, match="unknown policy"):
            decide(ClusterState(0.0, (), (), (), config=PolicyConfig(name="nope")))
        assert gc.isenabled() is enabled
        assert seen == [False, False]
    finally:
        gc.enable()
