"""Stage 8 (gpulab only): a preemption plan for the top blocked job.

Only for a job of a non-preemptible class; victims are running jobs marked
``preemptible`` that were preempted fewer than ``preempt_max_per_hour`` times in the
last hour (so a best-effort job is never stopped for another best-effort job, nor
stopped over and over). Kueue's ``minimalPreemptions``: order the candidates (groups
over their fair share first, then lower priority, then the youngest), free them one
by one on a scratch ledger until the job fits, then add them back in reverse (all but
the last removed) while it still fits. What is left is the minimal set this order
gives. A GPU frees only when every running job on it is a victim, and only GPUs of
schedulable nodes count. At most one plan per pass (``multifactor`` asks once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.policy.place import _fitting, is_gang, place
from scheduler.policy.priority import class_factor

if TYPE_CHECKING:
    from scheduler.policy.fairshare import FairShare
    from scheduler.policy.index import Constraint, PassIndex
    from scheduler.policy.ledger import Ledger
    from scheduler.policy.state import GpuView, Placement, RunningJob


def candidates(idx: PassIndex, fairshare: FairShare) -> list[RunningJob]:
    state = idx.state
    cfg = state.config

    def key(r: RunningJob) -> tuple[int, float, float, int]:
        prio = cfg.weight_class * class_factor(
            r.priority_class, 0.0, state.classes
        ) + cfg.weight_fairshare * fairshare.of(r.group, r.user)
        return (0 if fairshare.over_share(r.group) else 1, prio, -r.started_at, r.id)

    return sorted(
        (
            r
            for r in state.running
            if r.preemptible and r.preemptions_last_hour < cfg.preempt_max_per_hour
        ),
        key=key,
    )


def plan(
    c: Constraint,
    k: int,
    ledger: Ledger,
    idx: PassIndex,
    fairshare: FairShare,
    *,
    spread: bool,
    topology: bool,
) -> tuple[list[RunningJob], tuple[Placement, ...]] | None:
    """(victims in removal order, where the job then goes), or None."""
    cands = candidates(idx, fairshare)
    if not cands:
        return None
    view = idx.view(c)
    gang = is_gang(idx, c, k)
    on_gpu: dict[int, set[int]] = {}
    for r in idx.state.running:
        for gid in r.gpu_ids:
            on_gpu.setdefault(gid, set()).add(r.id)
    scratch = ledger.copy()

    def freed_by(victims: set[int], r: RunningJob) -> list[GpuView]:
        out = []
        for gid in r.gpu_ids:
            gpu = idx.gpu_by_id.get(gid)
            if gpu is None or not gpu.schedulable or gpu.slots <= 0:
                continue
            if gpu.node_id not in idx.schedulable_nodes:
                continue
            if on_gpu[gid] <= victims:
                out.append(gpu)
        return out

    def fits_now() -> bool:
        return place(scratch, idx, c, k, spread=spread) is not None

    total = 0
    if gang:
        total = sum(
            len(_fitting(scratch, idx, c, n, frozenset())) for n in scratch.free
        )
    removed: list[RunningJob] = []
    victims: set[int] = set()
    freed: dict[int, list[GpuView]] = {}
    fits = False
    for r in cands:
        removed.append(r)
        victims.add(r.id)
        gpus = freed_by(victims, r)
        freed[r.id] = gpus
        by_node: dict[int, list[GpuView]] = {}
        for g in gpus:
            by_node.setdefault(g.node_id, []).append(g)
        for node_id, gs in by_node.items():
            scratch.give(node_id, gs)
        if gang:
            total += sum(1 for g in gpus if g.id in view.matching)
            fits = total >= k
        else:
            fits = any(
                len(_fitting(scratch, idx, c, n, frozenset())) >= k for n in by_node
            )
        if fits:
            break
    if not fits:
        return None
    for r in reversed(removed[:-1]):
        gpus = freed[r.id]
        for g in gpus:
            scratch.take(g.node_id, (g.id,))
        if fits_now():
            victims.discard(r.id)
        else:
            by_node = {}
            for g in gpus:
                by_node.setdefault(g.node_id, []).append(g)
            for node_id, gs in by_node.items():
                scratch.give(node_id, gs)
    placements = place(scratch, idx, c, k, spread=spread, topology=topology)
    if placements is None:  # pragma: no cover - it fitted above
        return None
    return [r for r in removed if r.id in victims], placements
