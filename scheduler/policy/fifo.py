"""The ``fifo`` policy: class weight, then submit order; exclusive first fit
(best fit) on one node; no reservations, no backfill, no preemption. The
foundation's policy, kept as a baseline for the simulator."""

from __future__ import annotations

import time

from scheduler.policy import dependency
from scheduler.policy.arrays import ArrayLimits
from scheduler.policy.quota import Quotas
from scheduler.policy.state import (
    STAGE_ORDERING,
    STAGE_PLACEMENT,
    ClusterState,
    Decision,
    GpuView,
    PassResult,
    PassStats,
    PendingJob,
    Placement,
    Reason,
    Start,
    Wait,
)


def order_key(job: PendingJob) -> tuple[float, float, int]:
    """Stable scheduling order: higher priority first, then older, then lower id."""
    return (-job.priority_weight, job.submitted_at, job.id)


def _fits(gpu: GpuView, job: PendingJob) -> bool:
    return gpu.schedulable and (
        job.gpu_memory_mib is None or gpu.memory_total_mib >= job.gpu_memory_mib
    )


def _gpus_by_node(
    state: ClusterState,
) -> tuple[dict[int, list[GpuView]], dict[int, list[GpuView]]]:
    """By node, in index order: the wholly free schedulable GPUs of schedulable
    nodes, and every GPU (what the node could hold empty)."""
    schedulable_nodes = {n.id for n in state.nodes if n.schedulable}
    free: dict[int, list[GpuView]] = {node_id: [] for node_id in schedulable_nodes}
    capacity: dict[int, list[GpuView]] = {n.id: [] for n in state.nodes}
    for gpu in sorted(state.gpus, key=lambda g: (g.node_id, g.index)):
        capacity.setdefault(gpu.node_id, []).append(gpu)
        if gpu.node_id in free and gpu.free_slots == gpu.slots and gpu.schedulable:
            free[gpu.node_id].append(gpu)
    return free, capacity


def run_fifo(state: ClusterState) -> PassResult:
    """Decide which pending jobs start now, where, and why the others wait, and
    the pass's ``PassStats`` (fifo never reserves, preempts or backfills, and
    always reaches the end of the queue; its stages are ordering and placement,
    timed with ``time.perf_counter`` for the record only).

    1. Order the pending jobs (``order_key``).
    2. For each, find the schedulable nodes with enough whole free GPUs (every slot
       free, enough memory) and take the best fit: the node with the fewest such free
       GPUs, so large holes stay open for large jobs; lowest GPU indexes first.
    A job whose dependencies are not met (``dependency.py``), whose array runs its
    limit of tasks (``arrays.py``) or that its quotas refuse (``quota.py``) waits
    with that reason and is not placed (fifo has no fair share: soft quotas
    change nothing here).
    3. A job that fits no node waits: ``NO_SUCH_SHAPE`` if no node could hold it even
       when empty, else ``RESOURCES``. Later jobs may still start (no reservations yet).
    """
    t0 = time.perf_counter()
    order = sorted(state.pending, key=order_key)
    t1 = time.perf_counter()
    names = {n.id: n.name for n in state.nodes}
    free, capacity = _gpus_by_node(state)

    decisions: list[Decision] = []
    quotas = Quotas(state.quotas, state.config.quota_soft_factor)
    arrays = ArrayLimits(state.running)
    if quotas and state.config.quota_overrun == "stop":
        decisions.extend(quotas.overruns(state.running))
    position = 0
    # Within a pass free GPUs only go: once k GPUs of some memory fail to fit, any
    # later job asking for k or more of that memory fails too (no search), and the
    # waiting messages are computed once per shape between two starts.
    failed: dict[int | None, int] = {}
    could: dict[tuple[int, int | None], bool] = {}
    most_free: dict[int | None, int] = {}
    started = 0
    for job in order:
        mem = job.gpu_memory_mib
        gated = dependency.refusal(job)
        if gated is None and (limited := arrays.refusal(job)) is not None:
            gated = (Reason.ARRAY_LIMIT, limited)
        if gated is None and quotas:
            refused = quotas.refusal(job, state.now)
            gated = None if refused is None else (Reason.QUOTA, refused)
        if gated is not None:
            position += 1
            decisions.append(Wait(job.id, gated[0], gated[1], position))
            continue
        candidates = []
        if failed.get(mem, job.gpus + 1) > job.gpus:
            for node_id, gpus in free.items():
                fitting = [g for g in gpus if _fits(g, job)]
                if len(fitting) >= job.gpus:
                    candidates.append((len(fitting), names.get(node_id, ""), node_id))
        if candidates:
            _, _, node_id = min(candidates)
            chosen = [g for g in free[node_id] if _fits(g, job)][: job.gpus]
            taken = {g.id for g in chosen}
            free[node_id] = [g for g in free[node_id] if g.id not in taken]
            most_free.clear()
            decisions.append(
                Start(job.id, (Placement(node_id, tuple(g.id for g in chosen)),))
            )
            started += 1
            if quotas:
                quotas.take(job)
            arrays.take(job)
            continue
        failed[mem] = min(failed.get(mem, job.gpus), job.gpus)
        position += 1
        shape = (job.gpus, mem)
        if shape not in could:
            could[shape] = any(
                sum(1 for g in gpus if _fits(g, job)) >= job.gpus
                for gpus in capacity.values()
            )
        if not could[shape]:
            text = f" with {mem} MiB" if mem else ""
            message = f"no node has {job.gpus} schedulable GPU(s){text}"
            decisions.append(Wait(job.id, Reason.NO_SUCH_SHAPE, message, position))
        else:
            if mem not in most_free:
                most_free[mem] = max(
                    (sum(1 for g in gpus if _fits(g, job)) for gpus in free.values()),
                    default=0,
                )
            message = (
                f"waiting for {job.gpus} free GPU(s) on one node "
                f"(most free on one node now: {most_free[mem]})"
            )
            decisions.append(Wait(job.id, Reason.RESOURCES, message, position))
    stage_s = {STAGE_ORDERING: t1 - t0, STAGE_PLACEMENT: time.perf_counter() - t1}
    return PassResult(
        decisions, PassStats(considered=len(order), started=started, stage_s=stage_s)
    )
