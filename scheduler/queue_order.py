"""Stable order keys for the waiting jobs (pure: no Django).

A pass orders every waiting job. Were each job's 1-based place stored, one start
at the head would shift every place behind it: each pass would rewrite nearly every
waiting row (95 % of them in a burst of submissions, bench/submit_burst.py), and
the queue's pages would wait on that database work. So each waiting job stores
an order key (``Job.queue_order``): the keys increase along the pass's order, and
a job's place is counted when it is read
(``scheduler.models.attach_queue_positions``). A start, an end or a cancellation
then rewrites nothing; a pass changes the keys of the jobs whose order relative
to the others changed, and gives new jobs theirs.

``assign`` keeps the longest run of stored keys that is already in order (a
longest increasing subsequence) and fits every other job in the gaps between
them. Keys are spaced ``STEP`` apart when there is room, so a new job lands
between two others without moving them. When a gap is used up (jobs keep
landing at one spot) the neighbourhood is spread out afresh, twice as wide each
time until it leaves ``MIN_GAP`` between two keys, as in an order-maintenance
list: rewrites stay local and few on average; the whole queue is renumbered only
if nothing less will do.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# Spacing of fresh keys: 2**20 leaves room for twenty halvings between two jobs.
STEP = 1 << 20
# Keys stay well inside PostgreSQL's bigint (signed 64 bits).
LIMIT = 1 << 62
# A neighbourhood spread out afresh leaves at least this much between two keys.
MIN_GAP = 1 << 10


def assign(order: Sequence[int], stored: Mapping[int, int | None]) -> dict[int, int]:
    """The new keys of the jobs of ``order`` (ids, first to last) whose key must
    change; every other job keeps its stored key. ``stored`` maps a job id to its
    key (None or absent: it has none). Afterwards the keys strictly increase
    along ``order``."""
    old = [stored.get(job_id) for job_id in order]
    keep = _kept(old)
    cur: list[int | None] = list(old)  # the keys so far; final left of ``i``
    n = len(order)
    i = 0
    while i < n:
        if keep[i]:
            i += 1
            continue
        j = i
        while j < n and not keep[j]:
            j += 1
        # order[i:j] need keys between their kept neighbours (if any) ...
        keys = _between(cur[i - 1] if i else None, old[j] if j < n else None, j - i)
        while keys is None:
            # ... and where they do not fit, the neighbourhood is spread out
            # afresh: twice as wide each time, until it leaves MIN_GAP a job
            # (so it is not filled again at once); the whole queue at worst.
            width = j - i
            i, j = max(0, i - width), min(n, j + width)
            while j < n and not keep[j]:
                j += 1
            keys = _between(
                cur[i - 1] if i else None,
                old[j] if j < n else None,
                j - i,
                min_gap=MIN_GAP,
            )
        cur[i:j] = keys
        i = j
    return {
        job_id: key
        for job_id, key, was in zip(order, cur, old, strict=True)
        if key != was and key is not None
    }


def _kept(old: Sequence[int | None]) -> list[bool]:
    """Which stored keys stay: a longest strictly increasing subsequence of them
    (patience sorting, O(n log n)); a run already in order costs one scan."""
    keep = [False] * len(old)
    present = [
        (i, k) for i, k in enumerate(old) if k is not None and -LIMIT < k < LIMIT
    ]
    if all(a[1] < b[1] for a, b in itertools.pairwise(present)):
        for i, _ in present:
            keep[i] = True
        return keep
    tails: list[int] = []  # smallest tail key of an increasing run of each length
    tail_at: list[int] = []  # its index in ``old``
    parent: dict[int, int] = {}
    for i, key in present:
        length = bisect_left(tails, key)
        if length:
            parent[i] = tail_at[length - 1]
        if length == len(tails):
            tails.append(key)
            tail_at.append(i)
        else:
            tails[length] = key
            tail_at[length] = i
    at = tail_at[-1] if tail_at else None
    while at is not None:
        keep[at] = True
        at = parent.get(at)
    return keep


def _between(
    lo: int | None, hi: int | None, m: int, *, min_gap: int = 1
) -> list[int] | None:
    """``m`` increasing keys strictly between ``lo`` and ``hi`` (None: open end),
    ``STEP`` apart where an end is open, evenly spread otherwise; None if they do
    not fit at least ``min_gap`` apart."""
    if lo is None and hi is None:
        keys = [STEP * (k + 1) for k in range(m)]
    elif lo is None:
        assert hi is not None
        keys = [hi - STEP * (m - k) for k in range(m)]
    elif hi is None:
        keys = [lo + STEP * (k + 1) for k in range(m)]
    else:
        gap = hi - lo
        if gap < (m + 1) * min_gap:
            return None
        keys = [lo + gap * (k + 1) // (m + 1) for k in range(m)]
    if keys and not (keys[0] > -LIMIT and keys[-1] < LIMIT):
        return None
    return keys
