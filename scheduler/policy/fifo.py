"""The ``fifo`` and ``first-fit`` policies: class weight, then submit order;
exclusive whole GPUs placed like the other policies (``place``: best fit on one
node, a gang on the fewest nodes when the job is wider than every node); no
reservations, no backfill, no preemption.

- ``fifo`` is a strict FIFO: the first job in that order that does not fit the
  free GPUs blocks every later one (they wait with ``PRIORITY``), so a wide job is
  never overtaken. A job held by a node-independent rule (dependency, array
  limit, quota) or that no set of nodes could ever hold waits with that reason and
  blocks nothing.
- ``first-fit`` (simulator only) is greedy: a job that does not fit waits and the
  later ones still start where they fit. It shows what not protecting wide jobs
  buys on the average and costs on the tail.
"""

from __future__ import annotations

import time

from scheduler.policy import dependency, index, place
from scheduler.policy.arrays import ArrayLimits
from scheduler.policy.ledger import Ledger
from scheduler.policy.quota import Quotas
from scheduler.policy.reasons import Messages
from scheduler.policy.state import (
    STAGE_ORDERING,
    STAGE_PLACEMENT,
    ClusterState,
    Decision,
    PassResult,
    PassStats,
    PendingJob,
    Reason,
    Start,
    Wait,
)

FIFO = "fifo"
FIRST_FIT = "first-fit"


def order_key(job: PendingJob) -> tuple[float, float, int]:
    """Stable scheduling order: higher priority first, then older, then lower id."""
    return (-job.priority_weight, job.submitted_at, job.id)


def run_fifo(state: ClusterState, *, strict: bool = True) -> PassResult:
    """Decide which pending jobs start now, where, and why the others wait, and
    the pass's ``PassStats`` (no reservation, preemption or backfill; the pass
    always reaches the end of the queue; its stages are ordering and placement,
    timed with ``time.perf_counter`` for the record only).

    1. Order the pending jobs (``order_key``).
    2. Gate each: dependencies (``dependency.py``), array limits (``arrays.py``),
       quotas (``quota.py``; no fair share here, so soft quotas change nothing), a
       shape no set of nodes could ever hold (``NO_SUCH_SHAPE``): it waits with
       that reason.
    3. Place it with ``place.place`` (best fit, lowest indexes; a gang on the
       fewest nodes). A job that does not fit waits (``RESOURCES``); ``strict``
       (``fifo``): every later job that passes its gates then waits behind it
       (``PRIORITY``), else (``first-fit``) later jobs may still start.
    """
    t0 = time.perf_counter()
    order = sorted(state.pending, key=order_key)
    t1 = time.perf_counter()
    idx = index.build(state, predictions=False)
    ledger = Ledger({n: gs.copy() for n, gs in idx.free_now.items()}, idx.node_rank)
    messages = Messages(idx)

    decisions: list[Decision] = []
    quotas = Quotas(state.quotas, state.config.quota_soft_factor)
    arrays = ArrayLimits(state.running)
    if quotas and state.config.quota_overrun == "stop":
        decisions.extend(quotas.overruns(state.running))
    position = 0
    # Within a pass free GPUs only go: once k GPUs of a constraint (one node or a
    # gang) fail to fit, any later job asking k or more of it fails too.
    failed: dict[tuple[bool, index.Constraint], int] = {}
    blocker: PendingJob | None = None
    short: list[tuple[int, PendingJob, index.Constraint, int]] = []
    started = 0
    for job in order:
        c = idx.constraint(job)
        gated = dependency.refusal(job)
        if gated is None and (limited := arrays.refusal(job)) is not None:
            gated = (Reason.ARRAY_LIMIT, limited)
        if gated is None and not place.could_ever(idx, c, job.gpus):
            gated = (Reason.NO_SUCH_SHAPE, messages.no_such_shape(c, job.gpus))
        if gated is None and quotas:
            refused = quotas.refusal(job, state.now)
            gated = None if refused is None else (Reason.QUOTA, refused)
        if gated is not None:
            position += 1
            decisions.append(Wait(job.id, gated[0], gated[1], position))
            continue
        if blocker is not None:
            position += 1
            message = (
                f"behind job {blocker.id}, the first job in class and submit order"
                " that does not fit now (strict FIFO)"
            )
            decisions.append(Wait(job.id, Reason.PRIORITY, message, position))
            continue
        key = (place.is_gang(idx, c, job.gpus), c)
        placements = None
        if failed.get(key, job.gpus + 1) > job.gpus:
            placements = place.place(ledger, idx, c, job.gpus)
        if placements is not None:
            place.take(ledger, placements)
            decisions.append(Start(job.id, placements))
            started += 1
            if quotas:
                quotas.take(job)
            arrays.take(job)
            continue
        failed[key] = min(failed.get(key, job.gpus), job.gpus)
        position += 1
        # the message is written once the pass's starts are known (what stays free)
        short.append((len(decisions), job, c, position))
        decisions.append(Wait(job.id, Reason.RESOURCES, "", position))
        if strict:
            blocker = job
    for at, job, c, pos in short:
        text = messages.resources(c, job.gpus, ledger)
        decisions[at] = Wait(job.id, Reason.RESOURCES, text, pos)
    stage_s = {STAGE_ORDERING: t1 - t0, STAGE_PLACEMENT: time.perf_counter() - t1}
    return PassResult(
        decisions, PassStats(considered=len(order), started=started, stage_s=stage_s)
    )
