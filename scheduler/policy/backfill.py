"""The reservation stage: the EASY reservation (shadow time) for the top blocked job.

Walk the running jobs in planned-end order (``PassIndex.planned_end``: started_at +
min(limit, prediction), or + limit in ``slurm``, whose backfill plans with limits), releasing each GPU when the last job on it is planned to end,
into a scratch ledger, until the blocked job fits: that time (never before ``now``) is
its shadow time, and the GPUs it would take then are reserved. A later job may start
now only if it fits now and either ends (by its plan) by the shadow time or takes none
of the reserved GPUs (``stages.backfill_one`` applies the rule). One reservation per pass, as
in EASY. A job that never fits (it needs nodes that are down) gets no reservation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.policy.place import _fitting, is_gang, place

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from scheduler.policy.index import Constraint, PassIndex
    from scheduler.policy.ledger import Ledger
    from scheduler.policy.state import GpuView, Placement, RunningJob


@dataclass(frozen=True)
class Reservation:
    job_id: int
    shadow: float | None  # None: the job cannot be planned (no reservation)
    placements: tuple[Placement, ...] = ()
    gpu_ids: frozenset[int] = frozenset()
    behind: int | None = None  # the running job whose end it waits for last
    victims: tuple[int, ...] = ()  # set when the reservation is a preemption plan


def releases(
    idx: PassIndex,
    running: Iterable[RunningJob],
    end_of: Callable[[RunningJob], float] | None = None,
) -> list[tuple[float, int, list[GpuView]]]:
    """(time, job id, GPUs) in time order: when busy schedulable GPUs free, by
    planned ends (``end_of``, default ``idx.planned_end``; a GPU frees with the
    last job on it; a job being stopped frees its GPUs now)."""
    last: dict[int, tuple[float, int]] = {}
    now = idx.state.now
    end_of = end_of or idx.planned_end
    for r in running:
        end = end_of(r)
        if r.stopping:
            end = min(end, now)
        key = (end, r.id)
        for gid in r.gpu_ids:
            if gid not in last or key > last[gid]:
                last[gid] = key
    groups: dict[tuple[float, int], list[GpuView]] = {}
    gpu_by_id = idx.gpu_by_id
    schedulable = idx.schedulable_nodes
    for gid, key in last.items():
        gpu = gpu_by_id.get(gid)
        if gpu is None or gpu.node_id not in schedulable:
            continue
        if not gpu.schedulable or gpu.slots <= 0:
            continue
        groups.setdefault(key, []).append(gpu)
    return [(t, job_id, groups[t, job_id]) for t, job_id in sorted(groups)]


def reserve(
    job_id: int,
    c: Constraint,
    k: int,
    ledger: Ledger,
    idx: PassIndex,
    running: Iterable[RunningJob],
    *,
    spread: bool,
    topology: bool,
    end_of: Callable[[RunningJob], float] | None = None,
) -> Reservation:
    """The shadow time and GPUs of ``job_id`` (``k`` GPUs of ``c``): the running
    jobs' GPUs released at their ends (``end_of``, default ``idx.planned_end``)
    until it fits."""
    scratch = ledger.copy()
    view = idx.view(c)
    gang = is_gang(idx, c, k)
    total = 0
    if gang:
        total = sum(
            len(_fitting(scratch, idx, c, n, frozenset())) for n in scratch.free
        )
    events = releases(idx, running, end_of)
    i = 0
    while i < len(events):
        t = events[i][0]
        touched: dict[int, list[GpuView]] = {}
        behind = events[i][1]
        while i < len(events) and events[i][0] == t:
            _, behind, gpus = events[i]
            for gpu in gpus:
                touched.setdefault(gpu.node_id, []).append(gpu)
            i += 1
        for node_id, gpus in touched.items():
            if gang:
                have = {g.id for g in scratch.free.get(node_id, ())}
                total += sum(
                    1 for g in gpus if g.id in view.matching and g.id not in have
                )
            scratch.give(node_id, gpus)
        if gang:
            fits = total >= k
        else:
            fits = any(
                len(_fitting(scratch, idx, c, n, frozenset())) >= k for n in touched
            )
        if fits:
            placements = place(scratch, idx, c, k, spread=spread, topology=topology)
            if placements is None:  # pragma: no cover - fits said it would
                continue
            return Reservation(
                job_id,
                max(t, idx.state.now),
                placements,
                frozenset(g for p in placements for g in p.gpu_ids),
                behind,
            )
    return Reservation(job_id, None)
