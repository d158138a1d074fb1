"""The placement stage: placement on a ledger (exclusive whole GPUs).

- One node when the job fits a node of the cluster (its constraint's largest node):
  best fit ("pack": the node with the fewest fitting free GPUs that still fits, so
  large holes stay open for large jobs) or "spread" (the most); ties by node name,
  then id. Nodes are found through the ledger's free-count buckets, never a scan of
  every GPU; only nodes where the constraint matches some GPUs but not all (mixed
  models or memory) and nodes holding excluded GPUs are looked at one by one.
- Within the node (``topology=True``): the closest group of GPUs, scored by the
  number of member pairs not joined by NVLink, then the largest NVML
  common-ancestor level between members (``GpuView.topology``; unknown = far), then
  the lowest indexes. Without topology: the lowest indexes (plain best fit).
- A job larger than every node its constraint allows (a gang): all-or-nothing on the
  fewest nodes, largest free counts first and the last node chosen by best fit for
  the remainder; one ``Placement`` per node, rank 0 first. Nothing is taken unless
  every member has its GPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.policy.index import UNKNOWN_LEVEL
from scheduler.policy.state import Placement

if TYPE_CHECKING:
    from scheduler.policy.index import Constraint, PassIndex
    from scheduler.policy.ledger import Ledger
    from scheduler.policy.state import GpuView

NO_EXCLUSION: frozenset[int] = frozenset()


def is_gang(idx: PassIndex, c: Constraint, gpus: int) -> bool:
    """Does this shape need several nodes? (a job larger than every node that
    could hold its GPUs, counting nodes that are down: stable across passes)"""
    return gpus > idx.view(c).max_node_capacity


def could_ever(idx: PassIndex, c: Constraint, gpus: int) -> bool:
    """Could the whole cluster (nodes up or not) ever hold this shape?"""
    view = idx.view(c)
    if gpus <= view.max_node_capacity:
        return gpus > 0
    return view.total_capacity >= gpus


def _pair(a: GpuView, b: GpuView) -> tuple[int, int]:
    linked = b.index in a.nvlink_peers or a.index in b.nvlink_peers
    level = UNKNOWN_LEVEL
    for peer, lvl in a.topology:
        if peer == b.index:
            level = lvl
            break
    else:
        for peer, lvl in b.topology:
            if peer == a.index:
                level = lvl
                break
    return (0 if linked else 1, level)


def choose_gpus(fitting: list[GpuView], k: int, *, topology: bool) -> list[GpuView]:
    """k GPUs of ``fitting`` (sorted by index), the closest group when asked."""
    if not topology or k <= 1 or k >= len(fitting):
        return fitting[:k]
    pairs: dict[tuple[int, int], tuple[int, int]] = {}
    for i, a in enumerate(fitting):
        for b in fitting[i + 1 :]:
            pairs[(a.id, b.id)] = pairs[(b.id, a.id)] = _pair(a, b)
    best: tuple[tuple[int, int, tuple[int, ...]], list[GpuView]] | None = None
    for seed in fitting:
        group = [seed]
        rest = [g for g in fitting if g is not seed]
        while len(group) < k:

            def cost(g: GpuView, group: list[GpuView] = group) -> tuple[int, int, int]:
                links = [pairs[(g.id, m.id)] for m in group]
                return (sum(x[0] for x in links), max(x[1] for x in links), g.index)

            pick = min(rest, key=cost)
            group.append(pick)
            rest.remove(pick)
        group.sort(key=lambda g: g.index)
        links = [
            pairs[(a.id, b.id)] for i, a in enumerate(group) for b in group[i + 1 :]
        ]
        score = (
            sum(x[0] for x in links),
            max(x[1] for x in links),
            tuple(g.index for g in group),
        )
        if best is None or score < best[0]:
            best = (score, group)
    assert best is not None
    return best[1]


def _choose_ids(
    idx: PassIndex,
    node_id: int,
    fit: list[GpuView],
    k: int,
    topology: bool,  # noqa: FBT001
) -> tuple[int, ...]:
    """``choose_gpus``, memoised per node wiring (``PassIndex.signature``)."""
    if not topology or k <= 1 or k >= len(fit):
        return tuple(g.id for g in fit[:k])
    key = (idx.signature(node_id), tuple(g.index for g in fit), k)
    indexes = idx.choices.get(key)
    if indexes is None:
        chosen = choose_gpus(fit, k, topology=True)
        indexes = idx.choices[key] = tuple(g.index for g in chosen)
    by_index = {g.index: g.id for g in fit}
    return tuple(by_index[i] for i in indexes)


def _fitting(
    ledger: Ledger,
    idx: PassIndex,
    c: Constraint,
    node_id: int,
    exclude: frozenset[int],
) -> list[GpuView]:
    view = idx.view(c)
    free = ledger.free.get(node_id, [])
    if node_id in view.uniform and not exclude:
        return free
    return [g for g in free if g.id in view.matching and g.id not in exclude]


def find_node(
    ledger: Ledger,
    idx: PassIndex,
    c: Constraint,
    k: int,
    *,
    exclude: frozenset[int] = NO_EXCLUSION,
    spread: bool = False,
) -> tuple[int, list[GpuView]] | None:
    """The single node for k GPUs of constraint c, and its fitting free GPUs."""
    view = idx.view(c)
    special = view.mixed
    if exclude:
        special = special | {idx.gpu_by_id[g].node_id for g in exclude}
    best: tuple[tuple[int, tuple[str, int]], int, list[GpuView]] | None = None
    counts = sorted(
        (n for n, nodes in ledger.by_count.items() if n >= k and nodes),
        reverse=spread,
    )
    everywhere = len(view.uniform) == len(idx.gpus_by_node)
    for count in counts:
        bucket = ledger.by_count[count]
        first = None
        if ledger.rank is idx.node_rank:
            # the common case: no scan of the bucket. The bucket's first node in
            # rank order is the answer when the constraint takes all of its GPUs
            # and it is not special (excluded or mixed: looked at below)
            first = ledger.first(count)
            if first is None:
                continue
        if (
            first is not None
            and first not in special
            and (everywhere or first in view.uniform)
        ):
            cands = {first}
        else:
            cands = bucket if everywhere else bucket & view.uniform
            if special:
                cands = cands - special
        if cands:
            node_id = min(cands, key=idx.node_rank.__getitem__)
            rank = -count if spread else count
            best = ((rank, idx.node_key[node_id]), node_id, ledger.free[node_id])
            break
    for node_id in special:
        if node_id not in ledger.free:
            continue
        fit = _fitting(ledger, idx, c, node_id, exclude)
        if len(fit) < k:
            continue
        key = (-len(fit) if spread else len(fit), idx.node_key[node_id])
        if best is None or key < best[0]:
            best = (key, node_id, fit)
    return None if best is None else (best[1], best[2])


def find_gang(
    ledger: Ledger,
    idx: PassIndex,
    c: Constraint,
    k: int,
    *,
    exclude: frozenset[int] = NO_EXCLUSION,
) -> list[tuple[int, list[GpuView]]] | None:
    """The fewest nodes for k GPUs (rank order) and each one's fitting free GPUs."""
    fits: list[tuple[int, list[GpuView]]] = []
    total = 0
    for node_id, free in ledger.free.items():
        if not free:
            continue
        fit = _fitting(ledger, idx, c, node_id, exclude)
        if fit:
            fits.append((node_id, fit))
            total += len(fit)
    if total < k:
        return None
    fits.sort(key=lambda f: (-len(f[1]), idx.node_key[f[0]]))
    chosen: list[tuple[int, list[GpuView]]] = []
    need = k
    for i, (node_id, fit) in enumerate(fits):
        if len(fit) >= need:
            last = min(
                (f for f in fits[i:] if len(f[1]) >= need),
                key=lambda f: (len(f[1]), idx.node_key[f[0]]),
            )
            chosen.append(last)
            break
        chosen.append((node_id, fit))
        need -= len(fit)
    return chosen


def place(
    ledger: Ledger,
    idx: PassIndex,
    c: Constraint,
    k: int,
    *,
    exclude: frozenset[int] = NO_EXCLUSION,
    spread: bool = False,
    topology: bool = False,
) -> tuple[Placement, ...] | None:
    """Where k GPUs of constraint c go now on ``ledger`` (not taken), or None."""
    if k <= 0:
        return None
    if not is_gang(idx, c, k):
        found = find_node(ledger, idx, c, k, exclude=exclude, spread=spread)
        if found is None:
            return None
        node_id, fit = found
        return (Placement(node_id, _choose_ids(idx, node_id, fit, k, topology)),)
    gang = find_gang(ledger, idx, c, k, exclude=exclude)
    if gang is None:
        return None
    placements = []
    need = k
    for node_id, fit in gang:
        n = min(need, len(fit))
        placements.append(
            Placement(node_id, _choose_ids(idx, node_id, fit, n, topology))
        )
        need -= n
    return tuple(placements)


def take(ledger: Ledger, placements: tuple[Placement, ...]) -> None:
    for p in placements:
        ledger.take(p.node_id, p.gpu_ids)
