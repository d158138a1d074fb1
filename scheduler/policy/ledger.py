"""The pass's mutable view of free GPUs: per node, and nodes bucketed by their free
count so best fit never scans the whole cluster (Volcano's session, Kubernetes'
Reserve/Unreserve). ``copy`` gives the backfill timeline and the preemption planner
a scratch ledger to play "what if" on without touching the real one."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from scheduler.policy.state import GpuView


class Ledger:
    def __init__(
        self, free: dict[int, list[GpuView]], rank: Mapping[int, int] | None = None
    ) -> None:
        """``free``: node -> its free GPUs, each list sorted by index (taken over).
        ``rank``: the pass's node order (``PassIndex.node_rank``), for ``first``."""
        self.free: dict[int, list[GpuView]] = free
        self.rank = rank
        self.by_count: dict[int, set[int]] = {}
        for node_id, gpus in self.free.items():
            self.by_count.setdefault(len(gpus), set()).add(node_id)
        self.total = sum(len(gs) for gs in self.free.values())
        # per bucket, built on first use: (rank, node) min-heaps with lazy deletion
        # (an entry whose node left the bucket is dropped when it reaches the top)
        self._heaps: dict[int, list[tuple[int, int]]] = {}

    def copy(self) -> Ledger:
        return Ledger({n: gs.copy() for n, gs in self.free.items()}, self.rank)

    def first(self, count: int) -> int | None:
        """The bucket's node that comes first in ``rank`` order, in O(log n)
        amortised instead of a scan of the bucket (best fit asks this once per
        start: with a scan, 1,000 starts over 500 nodes are a third of a pass)."""
        bucket = self.by_count.get(count)
        if not bucket:
            return None
        rank = self.rank
        if rank is None:
            return min(bucket)  # no order given: the lowest id
        heap = self._heaps.get(count)
        if heap is None:
            heap = self._heaps[count] = [(rank[n], n) for n in bucket]
            heapq.heapify(heap)
        while heap[0][1] not in bucket:
            heapq.heappop(heap)
        return heap[0][1]

    @property
    def max_count(self) -> int:
        return max((c for c, nodes in self.by_count.items() if nodes), default=0)

    def _move(self, node_id: int, old: int, new: int) -> None:
        bucket = self.by_count.get(old)
        if bucket is not None:
            bucket.discard(node_id)
        target = self.by_count.setdefault(new, set())
        if node_id not in target:
            target.add(node_id)
            heap = self._heaps.get(new)
            if heap is not None and self.rank is not None:
                heapq.heappush(heap, (self.rank[node_id], node_id))

    def take(self, node_id: int, gpu_ids: Iterable[int]) -> None:
        gone = set(gpu_ids)
        before = self.free.get(node_id, [])
        after = [g for g in before if g.id not in gone]
        if len(before) - len(after) != len(gone):
            raise ValueError(f"GPUs {sorted(gone)} are not all free on node {node_id}")
        self.free[node_id] = after
        self.total -= len(gone)
        self._move(node_id, len(before), len(after))

    def give(self, node_id: int, gpus: Iterable[GpuView]) -> None:
        before = self.free.setdefault(node_id, [])
        have = {g.id for g in before}
        new = [g for g in gpus if g.id not in have]
        if not new:
            return
        after = sorted([*before, *new], key=lambda g: g.index)
        self.free[node_id] = after
        self.total += len(new)
        self._move(node_id, len(before), len(after))
