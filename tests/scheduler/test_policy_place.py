"""Placement (the placement stage): best fit, spread, constraints, topology, gangs."""

from __future__ import annotations

import pytest

from scheduler.policy import NodeView, Placement, Reason, Start, decide
from scheduler.policy.ledger import Ledger
from tests.scheduler.test_policy_support import (
    GPULAB,
    SLURM,
    cluster,
    node_gpus,
    pending,
    starts,
    waits,
)


@pytest.mark.parametrize("config", [GPULAB, SLURM])
def test_best_fit_takes_the_node_with_the_fewest_fitting_free_gpus(config):
    gpus = node_gpus(1, 4) + node_gpus(2, 4, busy=(0, 1)) + node_gpus(3, 4, busy=(0,))
    [start] = decide(cluster(gpus, [pending(1, 2)], config=config))
    assert start == Start.on(1, 2, (202, 203))


def test_spread_takes_the_node_with_the_most_free_gpus():
    gpus = node_gpus(1, 4, busy=(0,)) + node_gpus(2, 4)
    [start] = decide(cluster(gpus, [pending(1, 1)], placement="spread"))
    assert start == Start.on(1, 2, (200,))


@pytest.mark.parametrize(
    ("job", "node"),
    [
        (pending(1, 2, model="h100"), 2),  # case-insensitive substring
        (pending(1, 2, model="A100"), 1),
        (pending(1, 2, mem=40000), 2),  # only node 2 has 80 GB
        (pending(1, 1, mem=81920), 2),  # equal is enough
    ],
)
def test_model_and_memory_constraints(job, node):
    gpus = node_gpus(1, 2, mem=40000, model="NVIDIA A100-40GB") + node_gpus(
        2, 4, mem=81920, model="NVIDIA H100-80GB"
    )
    if job.gpu_memory_mib == 40000:
        gpus = node_gpus(1, 2, mem=39999, model="x") + node_gpus(2, 4)
    [start] = decide(cluster(gpus, [job]))
    assert start.placements[0].node_id == node


def test_constraint_on_a_mixed_node_takes_only_matching_gpus():
    mixed = node_gpus(1, 2, model="NVIDIA K80") + tuple(
        g.__class__(**{**g.__dict__, "id": 110 + g.index, "index": 2 + g.index})
        for g in node_gpus(1, 2, model="NVIDIA P100")
    )
    ds = decide(
        cluster(mixed, [pending(1, 2, model="p100"), pending(2, 3, model="k80")])
    )
    assert starts(ds)[1] == Start.on(1, 1, (110, 111))
    w = waits(ds)[2]
    assert w.reason is Reason.NO_SUCH_SHAPE


def test_a_model_no_node_has_gets_a_histogram_when_some_node_is_only_busy():
    gpus = (
        node_gpus(1, 4, model="NVIDIA P100", busy=(0, 1, 2))
        + node_gpus(2, 4, model="NVIDIA K80")
        + node_gpus(3, 4, model="NVIDIA K80")
    )
    w = waits(decide(cluster(gpus, [pending(1, 2, model="p100")])))[1]
    assert w.reason is Reason.RESOURCES
    assert "0/3 nodes fit: 2 model mismatch, 1 too few free GPUs" in w.message
    assert "at most 1 free on one node now" in w.message


def test_nvlink_pair_is_chosen_over_a_non_linked_pair():
    # free 0,1,2,3; only 2-3 share NVLink
    gpus = node_gpus(1, 4, nvlink={2: (3,), 3: (2,)})
    [start] = decide(cluster(gpus, [pending(1, 2)]))
    assert start == Start.on(1, 1, (102, 103))
    # slurm has no topology preference: lowest indexes
    [start] = decide(cluster(gpus, [pending(1, 2)], config=SLURM))
    assert start == Start.on(1, 1, (100, 101))


def test_the_lowest_common_ancestor_level_is_chosen():
    # levels: 0-1 across CPUs (50), 1-2 same switch (20), 2-3 same board (10)...
    levels = {
        (0, 1): 50,
        (0, 2): 50,
        (0, 3): 50,
        (1, 2): 30,
        (1, 3): 30,
        (2, 3): 10,
    }
    [start] = decide(cluster(node_gpus(1, 4, levels=levels), [pending(1, 2)]))
    assert start == Start.on(1, 1, (102, 103))
    # three GPUs: {1,2,3} has max level 30, any group with 0 has 50
    [start] = decide(cluster(node_gpus(1, 4, levels=levels), [pending(1, 3)]))
    assert start == Start.on(1, 1, (101, 102, 103))


def test_nvlink_ranks_above_topology_level():
    levels = {(0, 1): 10, (2, 3): 40}
    gpus = node_gpus(1, 4, levels=levels, nvlink={2: (3,), 3: (2,)})
    [start] = decide(cluster(gpus, [pending(1, 2)]))
    assert start == Start.on(1, 1, (102, 103))


def test_a_gang_goes_all_or_nothing_on_the_fewest_nodes_in_rank_order():
    # nodes of 4; free 4, 3, 2, 1: a 6-GPU job takes node 1 (4) then the best fit
    # for the remaining 2 (node 3, not node 2): two nodes, rank 0 first.
    gpus = (
        node_gpus(1, 4)
        + node_gpus(2, 4, busy=(0,))
        + node_gpus(3, 4, busy=(0, 1))
        + node_gpus(4, 4, busy=(0, 1, 2))
    )
    [start] = decide(cluster(gpus, [pending(1, 6)]))
    assert start.placements == (
        Placement(1, (100, 101, 102, 103)),
        Placement(3, (302, 303)),
    )
    all_ids = start.gpu_ids
    assert len(all_ids) == len(set(all_ids)) == 6


def test_a_gang_that_cannot_be_placed_fully_takes_nothing():
    gpus = node_gpus(1, 4) + node_gpus(2, 4, busy=(0, 1, 2))
    ds = decide(cluster(gpus, [pending(1, 6), pending(2, 1, planned=60.0)]))
    w = waits(ds)[1]
    assert w.reason is Reason.RESOURCES
    assert "4 fitting GPUs free now" in w.message  # after job 2 took one
    # nothing was taken for the gang: the small job still finds all 5 free GPUs
    assert starts(ds)[2].gpu_ids == (203,)


def test_a_gang_bigger_than_the_cluster_is_no_such_shape():
    w = waits(decide(cluster(node_gpus(1, 4) + node_gpus(2, 4), [pending(1, 9)])))[1]
    assert w.reason is Reason.NO_SUCH_SHAPE


def test_non_schedulable_nodes_and_gpus_are_never_used():
    gpus = node_gpus(1, 2) + node_gpus(2, 2, schedulable=False) + node_gpus(3, 2)
    nodes = [NodeView(1, "a", schedulable=False), NodeView(2, "b"), NodeView(3, "c")]
    ds = decide(
        cluster(gpus, [pending(1, 1), pending(2, 1), pending(3, 1)], nodes=nodes)
    )
    used = {g for s in starts(ds).values() for g in s.gpu_ids}
    assert used == {300, 301}
    assert waits(ds)[3].reason is Reason.RESOURCES


@pytest.mark.parametrize("config", [GPULAB, SLURM])
def test_no_gpu_is_given_twice_and_jobs_get_distinct_gpus(config):
    gpus = node_gpus(1, 8) + node_gpus(2, 8) + node_gpus(3, 4)
    jobs = [pending(i, 1 + i % 5, planned=600.0 * i) for i in range(1, 40)]
    taken = [
        g
        for s in starts(decide(cluster(gpus, jobs, config=config))).values()
        for g in s.gpu_ids
    ]
    assert len(taken) == len(set(taken))
    assert len(taken) <= 20


def test_ledger_first_follows_nodes_in_and_out_of_buckets():
    """``Ledger.first``: the bucket's first node in rank order, after takes and
    gives move nodes between buckets (lazy deletion must not return a stale one)."""
    gpus = {n: list(node_gpus(n, 2)) for n in (1, 2, 3)}
    rank = {3: 0, 1: 1, 2: 2}  # node 3 comes first
    ledger = Ledger({n: list(g) for n, g in gpus.items()}, rank)
    assert ledger.first(2) == 3
    ledger.take(3, [300])
    assert ledger.first(2) == 1
    assert ledger.first(1) == 3
    ledger.take(1, [100, 101])
    assert ledger.first(2) == 2
    ledger.give(3, [gpus[3][0]])
    assert ledger.first(2) == 3
    assert ledger.first(1) is None
    assert ledger.copy().first(2) == 3
    assert Ledger({n: list(g) for n, g in gpus.items()}).first(2) == 1  # no rank
