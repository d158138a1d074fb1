"""The reasons stage: messages for the one ``Reason`` each still-pending job gets.

Messages name the numbers a person needs: how many GPUs, how many are free, why each
node was refused (a Volcano-style histogram, "0/3 nodes fit: 2 too few free GPUs, 1
model mismatch"), when a reservation is planned and behind which job. Times are
formatted from ``state.now`` (UTC), never the wall clock. Histograms are cached per
job shape for the pass, so 10,000 waiting jobs of a few shapes cost a few scans.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from scheduler.policy.place import _fitting, is_gang

if TYPE_CHECKING:
    from scheduler.policy.index import Constraint, PassIndex
    from scheduler.policy.ledger import Ledger

# Node refusal categories, most severe first (Kueue's reasonSeverity).
DOWN = "down, draining or in maintenance"
MODEL = "model mismatch"
MEMORY = "too little GPU memory"
TOO_SMALL = "too few GPUs"
BUSY = "too few free GPUs"
ORDER = (DOWN, MODEL, MEMORY, TOO_SMALL, BUSY)


def duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    m, _ = divmod(s, 60)
    if m < 60:
        return f"{m}m"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"


def when(ts: float, now: float) -> str:
    at = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{at} (in {duration(ts - now)})"


def gpus_word(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def shape(c: Constraint, k: int, idx: PassIndex) -> str:
    where = "across nodes" if is_gang(idx, c, k) else "on one node"
    extra = []
    if c.model:
        extra.append(f"model ~{c.model!r}")
    if c.mem is not None:
        extra.append(f">= {c.mem} MiB")
    more = f" ({', '.join(extra)})" if extra else ""
    return f"{gpus_word(k)}{more} {where}"


class Messages:
    """Renders messages against the pass's final ledger (``stages.render_waits``): every number is
    what is free after this pass's starts. Per constraint the node categories that
    do not change (down, model, memory, too small) are counted once; the free part
    comes from the ledger's free-count buckets with set operations, so a histogram
    costs O(buckets + mixed nodes), not O(nodes), and is cached per shape."""

    def __init__(self, idx: PassIndex) -> None:
        self.idx = idx
        self._cache: dict[tuple[Constraint, int], str] = {}
        self._static: dict[
            Constraint,
            tuple[dict[str, int], frozenset[int], frozenset[int], dict[int, int]],
        ] = {}

    def _categories(
        self, c: Constraint
    ) -> tuple[dict[str, int], frozenset[int], frozenset[int], dict[int, int]]:
        """(counts of nodes refused whatever k, the schedulable nodes left, those of
        them whose every GPU matches, how many of them have each capacity)."""
        got = self._static.get(c)
        if got is not None:
            return got
        idx = self.idx
        view = idx.view(c)
        counts: dict[str, int] = {}
        eligible = set()
        kinds = idx.kinds_by_node
        # the model test per GPU kind (memory, model) of each node, not per GPU
        for node_id in idx.gpus_by_node:
            if node_id not in idx.schedulable_nodes:
                why = DOWN
            elif c.model and not any(c.model in m.lower() for _, m in kinds[node_id]):
                why = MODEL
            elif view.node_capacity.get(node_id, 0) == 0:
                why = MEMORY
            else:
                eligible.add(node_id)
                continue
            counts[why] = counts.get(why, 0) + 1
        capacities: dict[int, int] = {}
        for node_id in eligible:
            cap = view.node_capacity[node_id]
            capacities[cap] = capacities.get(cap, 0) + 1
        got = self._static[c] = (
            counts,
            frozenset(eligible),
            frozenset(eligible - view.mixed),
            capacities,
        )
        return got

    def resources(self, c: Constraint, k: int, ledger: Ledger) -> str:
        """'waiting for 4 GPUs on one node; at most 2 free on one node now (0/3
        nodes fit: 2 too few free GPUs, 1 model mismatch)'."""
        key = (c, k)
        got = self._cache.get(key)
        if got is not None:
            return got
        idx = self.idx
        view = idx.view(c)
        static, eligible, uniform, capacities = self._categories(c)
        counts = dict(static)
        best = 0
        total = 0
        fit = 0
        for count, nodes in ledger.by_count.items():
            if not count or not nodes:
                continue
            n = len(nodes & uniform)
            if n:
                best = max(best, count)
                total += count * n
                if count >= k:
                    fit += n
        for node_id in eligible & view.mixed:
            n = len(_fitting(ledger, idx, c, node_id, frozenset()))
            best = max(best, n)
            total += n
            if n >= k:
                fit += 1
        small = sum(n for cap, n in capacities.items() if cap < k)
        if small:
            counts[TOO_SMALL] = small
        busy = len(eligible) - small - fit
        if busy:
            counts[BUSY] = busy
        if is_gang(idx, c, k):
            got = (
                f"waiting for {shape(c, k, idx)}; {total} fitting GPUs free now"
                f" (at most {best} on one node)"
            )
        else:
            n_nodes = len(idx.gpus_by_node)
            hist = ", ".join(f"{counts[w]} {w}" for w in ORDER if w in counts)
            got = (
                f"waiting for {shape(c, k, idx)}; at most {best} free on one node now"
                f" ({fit}/{n_nodes} nodes fit: {hist})"
            )
        self._cache[key] = got
        return got

    def no_such_shape(self, c: Constraint, k: int) -> str:
        view = self.idx.view(c)
        return (
            f"no set of nodes can ever hold {shape(c, k, self.idx)}: the largest"
            f" node has {view.max_node_capacity} such GPUs, the cluster"
            f" {view.total_capacity}"
        )
