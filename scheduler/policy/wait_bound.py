"""The wait bound (``gpulab``): a batch job that has waited longer than
``PolicyConfig.max_wait_s`` (``GPULAB_MAX_WAIT``) goes first.

A job's wait is its time in the system not running: (now - submitted) less its
service time (attained GPU-seconds / its GPUs, every attempt), the definition of
the simulator's per-job waits. Shortest-first (the run-time factor), fair share
and attained service all reorder the queue, and none of them bounds how long a
long job of a heavy user may wait; this rule does, beside them:

- ``bound_order``: the overdue waiting jobs are taken out of the scheduling
  order and put back, oldest submission first, ahead of every other batch job of
  their class or of a lower class weight, whatever their priority; jobs of a
  higher class keep their places. So an overdue job is never passed by a younger
  job of its class or below, and it is the top blocked job (with the EASY
  reservation backfill respects) as soon as no higher-class job is ahead of it;
- ``overdue_running``: a running job that had waited that long is not preempted
  by attained service (``preempt.las_candidates``). Class preemption
  (``best-effort``) is unchanged.

The bound after a preemption (``PolicyConfig.preempted_max_wait_s``, off at 0)
is the same rule on a shorter clock for work that was already running: a waiting
job that was preempted (``PendingJob.preempted_at``) and has waited longer than
that since is overdue as above, and a running job whose attempt started that
long after its last preemption is not preempted by attained service again. LAS
preemption stops long jobs for short ones, and shortest-first then ranks the
stopped job behind every new short job: without this rule only ``max_wait_s``
brings it back (docs/policy.md, "A bound after a preemption").

Interactive jobs stay ahead of all batch work (``stages.ordering``) and are left
as they are. ``max_wait_s`` 0: no bound (``slurm`` and ``fifo`` never apply it).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import compress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from scheduler.policy.state import PendingJob, RunningJob


def waited_s(
    now: float, submitted_at: float, attained_gpu_s: float, gpus: int
) -> float:
    """Time in the system not running: ``now - submitted_at`` less the service
    time, ``attained_gpu_s / gpus``."""
    return now - submitted_at - attained_gpu_s / max(gpus, 1)


def overdue_running(
    r: RunningJob, now: float, max_wait_s: float, preempted_max_wait_s: float = 0.0
) -> bool:
    """The running ``r`` had waited longer than ``max_wait_s`` before this
    attempt (or between attempts), or this attempt started more than
    ``preempted_max_wait_s`` after its last preemption: it is not preempted by
    attained service. Each part is off at 0; the first is False when its
    submission is unknown."""
    if (
        preempted_max_wait_s > 0
        and r.preempted_at is not None
        and r.started_at - r.preempted_at > preempted_max_wait_s
    ):
        return True
    if max_wait_s <= 0 or r.submitted_at is None:
        return False
    return (
        waited_s(now, r.submitted_at, r.attained_gpu_s(now), len(r.gpu_ids))
        > max_wait_s
    )


def bound_order(
    order: list[PendingJob],
    now: float,
    max_wait_s: float,
    class_part: Callable[[PendingJob], float],
    interactive: set[str],
    preempted_max_wait_s: float = 0.0,
) -> list[PendingJob]:
    """``order`` (the scheduling order) with the overdue batch jobs moved up:
    waited over ``max_wait_s``, or preempted over ``preempted_max_wait_s`` ago.

    The overdue jobs of one class part ``c`` form a band, oldest submission
    first (then id), placed before the first other batch job whose class part is
    not above ``c``, or where the first of them already was if that is earlier
    (a max-aged job that priority put ahead of higher classes stays there); the
    bands go in class order, highest first. Every other job keeps its relative
    order, and no overdue job is placed after a job of its class or below that
    has not waited as long. ``order`` itself when none is overdue."""
    if max_wait_s <= 0 and preempted_max_wait_s <= 0:
        return order
    # submitted before ``cutoff`` is necessary (the service time is >= 0) and
    # cheap: one comparison per job in the common pass where none is overdue
    cutoff = now - max_wait_s if max_wait_s > 0 else -math.inf
    since = now - preempted_max_wait_s if preempted_max_wait_s > 0 else -math.inf
    over = [
        i
        for i, j in enumerate(order)
        if j.priority_class not in interactive
        and (
            (
                j.submitted_at < cutoff
                and cutoff - j.submitted_at > j.attained_gpu_s / max(j.gpus, 1)
            )
            or (j.preempted_at is not None and j.preempted_at < since)
        )
    ]
    if not over:
        return order
    bands: dict[float, list[int]] = {}
    for i in over:
        bands.setdefault(class_part(order[i]), []).append(i)
    levels = sorted(bands, reverse=True)
    n = len(order)
    keep = [True] * n
    for i in over:
        keep[i] = False
    # per level, the first job that is not overdue and whose class part is not
    # above it (one scan; levels are few)
    first = dict.fromkeys(levels, n)
    todo = levels
    for i, j in enumerate(order):
        if not keep[i] or j.priority_class in interactive:
            continue
        c = class_part(j)
        higher = []
        for lv in todo:
            if c <= lv:
                first[lv] = i
            else:
                higher.append(lv)
        todo = higher
        if not todo:
            break
    at: dict[int, list[int]] = {}
    floor = 0
    for lv in levels:
        band = bands[lv]
        pos = max(min(first[lv], band[0]), floor)
        floor = pos
        band.sort(key=lambda i: (order[i].submitted_at, order[i].id))
        at.setdefault(pos, []).extend(band)
    # the jobs that stay, in order, with each band spliced in before the job
    # that was at its position (``over`` is ascending)
    kept = list(compress(order, keep))
    out: list[PendingJob] = []
    done = 0
    for pos in sorted(at):
        r = pos - bisect_left(over, pos)
        out += kept[done:r]
        out += [order[k] for k in at[pos]]
        done = r
    out += kept[done:]
    return out
