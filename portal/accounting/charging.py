"""The charging rule, pure (no ORM, no clock): how one GPU's time is split between
the attempts that ran on it, and by UTC day.

At every instant a GPU runs attempts ``a1..ak`` (agent-reported start to end), each
is charged ``w_i / (w_1 + ... + w_k)`` of that instant, so over any interval the
GPU-seconds charged add up to exactly the time the GPU ran something: never twice,
never lost, whoever comes and goes. The weight ``w`` is the attempt's declared GPU
memory (``GPULAB_SHARED_CHARGE=memory``) or 1 (``equal``).

An attempt stopped to be requeued lost the work of its run from ``lost_from`` on
(its last checkpoint, or its start): that part of its share is lost work,
charged to nobody (``split_parts``); its neighbours' shares do not change, so
charged plus lost still add up to the GPU's time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

DAY = 86400.0


@dataclass(frozen=True)
class Run:
    """One attempt's run on one GPU: epoch seconds from its agent-reported start to
    its end (None: still running), its weight on a shared GPU, and where its lost
    work starts (``Attempt.lost_since``; None: nothing lost)."""

    attempt_id: int
    start: float
    end: float | None
    weight: float
    lost_from: float | None = None


def weight(mode: str, declared_mib: int | None, gpu_memory_mib: int) -> float:
    """An attempt's weight on a shared GPU. ``memory``: its declared GPU memory, at
    most the GPU's; a job that declared none counts as the whole GPU (it asked for
    no less). ``equal``: 1 each (what the occupancy of slots gave before)."""
    if mode == "equal":
        return 1.0
    whole = max(1, gpu_memory_mib)
    if declared_mib is None:
        return float(whole)
    return float(min(max(1, declared_mib), whole))


def day_of(at: float) -> date:
    """The UTC day an epoch second falls in."""
    return datetime.fromtimestamp(at, UTC).date()


def _midnights(since: float, until: float) -> list[float]:
    """UTC midnights strictly inside (since, until)."""
    first = datetime.combine(day_of(since), datetime.min.time(), UTC) + timedelta(1)
    out = []
    at = first.timestamp()
    while at < until:
        out.append(at)
        at += DAY
    return out


def pieces(
    runs: Iterable[Run], until: float, cuts: Iterable[float] = ()
) -> Iterator[tuple[float, float, dict[int, float]]]:
    """One GPU's time up to ``until``, cut where a run starts or ends and at each
    of ``cuts``: every piece in which something ran, as ``(t0, t1, shares)`` with
    each live attempt's share of it (by weight; they sum to 1). A running
    attempt runs up to ``until``; attempts that ran no time appear nowhere."""
    edges: list[tuple[float, int, Run]] = []
    for run in runs:
        end = until if run.end is None else min(run.end, until)
        if end <= run.start:
            continue
        edges.append((run.start, 1, run))
        edges.append((end, -1, run))
    if not edges:
        return
    times = sorted({t for t, _, _ in edges})
    lo, hi = times[0], times[-1]
    times = sorted({*times, *(c for c in cuts if lo < c < hi)})
    edges.sort(key=lambda e: (e[0], e[1]))  # ends before starts at one instant
    active: dict[int, float] = {}
    i = 0
    for t0, t1 in itertools.pairwise(times):
        while i < len(edges) and edges[i][0] <= t0:
            _, kind, run = edges[i]
            if kind > 0:
                active[run.attempt_id] = run.weight
            else:
                active.pop(run.attempt_id, None)
            i += 1
        total = sum(active.values())
        if not active or total <= 0:
            continue
        yield t0, t1, {a: w / total for a, w in active.items()}


ByDay = dict[int, dict[date, float]]


def split_parts(runs: Iterable[Run], until: float) -> tuple[ByDay, ByDay]:
    """GPU-seconds of each attempt on one GPU, by UTC day, up to ``until`` (a
    running attempt up to then at its current share): (charged, lost). A run's
    time from its ``lost_from`` on is lost, the rest charged.

    A sweep over the runs' starts and ends, their ``lost_from`` and the UTC
    midnights between (``pieces``): in each piece the attempts running share it
    by weight. Attempts that ran no time get no entry; one that lost nothing has
    none in the lost part."""
    runs = list(runs)
    starts = [r.start for r in runs]
    cuts = _midnights(min(starts), until) if starts else []
    lost_from = {r.attempt_id: r.lost_from for r in runs if r.lost_from is not None}
    cuts += lost_from.values()
    charged: ByDay = {}
    lost: ByDay = {}
    for t0, t1, shares in pieces(runs, until, cuts):
        day = day_of(t0)
        for attempt_id, share in shares.items():
            since = lost_from.get(attempt_id)
            out = lost if since is not None and t0 >= since else charged
            by_day = out.setdefault(attempt_id, {})
            by_day[day] = by_day.get(day, 0.0) + (t1 - t0) * share
    return charged, lost


def split(runs: Iterable[Run], until: float) -> ByDay:
    """GPU-seconds charged to each attempt on one GPU, by UTC day, up to ``until``:
    ``split_parts``' charged part (lost work is charged to nobody)."""
    return split_parts(runs, until)[0]


def charged(
    runs: Iterable[Run], until: float, since: float | None = None
) -> dict[int, float]:
    """GPU-seconds charged to each attempt on one GPU from ``since`` (None: from
    the start) to ``until``: ``split`` summed over the days, of the runs clipped at
    ``since``. Clipping is exact: the shares at an instant depend only on the runs
    live at that instant."""
    if since is not None:
        runs = [
            Run(r.attempt_id, max(r.start, since), r.end, r.weight)
            for r in runs
            if r.end is None or r.end > since
        ]
    else:
        runs = list(runs)
    if len(runs) == 1:  # alone on its GPU: all of it (the common case)
        [run] = runs
        end = until if run.end is None else min(run.end, until)
        return {run.attempt_id: end - run.start} if end > run.start else {}
    out: dict[int, float] = {}
    for t0, t1, shares in pieces(runs, until):
        for attempt_id, share in shares.items():
            out[attempt_id] = out.get(attempt_id, 0.0) + (t1 - t0) * share
    return out


def share_at(runs: Sequence[Run], attempt_id: int, at: float) -> float:
    """The attempt's share of the GPU at one instant (of the runs live then, itself
    counted live): the share of an attempt that ran no time."""
    live = {
        r.attempt_id: r.weight
        for r in runs
        if r.start <= at and (r.end is None or r.end > at)
    }
    mine = next((r.weight for r in runs if r.attempt_id == attempt_id), 1.0)
    live[attempt_id] = mine
    total = sum(live.values())
    return mine / total if total > 0 else 1.0
