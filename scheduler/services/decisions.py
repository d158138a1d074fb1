"""The scheduling pass's last end: ``apply_decisions`` applies one pass's
``Start``s (``starts.py``), ``Preempt``s, ``Evict``s, ``QuotaStop``s and ``Wait``s in
one transaction.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.db.models import Q

from scheduler import policy, queue_order
from scheduler.models import (
    Attempt,
    Job,
    JobEvent,
)
from scheduler.services.common import _event, _send_kill_on_commit, _ts, kill_terms
from scheduler.services.interference import mark_harmful
from scheduler.services.snapshot import StoredWait, policy_config
from scheduler.services.starts import start_jobs

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from agents import protocol


@dataclass
class ApplyResult:
    started: int = 0
    skipped: int = 0
    updated_reasons: int = 0
    preempted: int = 0
    evicted: int = 0
    quota_stopped: int = 0
    # Wall time of each part, for the pass's log line and bench/pass_scaling.py.
    starts_ms: float = 0.0
    preempts_ms: float = 0.0
    waits_ms: float = 0.0


def apply_decisions(
    decisions: Iterable[policy.Decision],
    stored_waits: Mapping[int, StoredWait] | None = None,
) -> ApplyResult:
    """Apply one pass's decisions in one transaction; ``stored_waits`` (from the
    pass's ``snapshot``) saves reading the waiting jobs' reasons again.

    1. The ``Start`` decisions together (``start_jobs``): lock the jobs (must still
       be PENDING) and their GPUs, in id order; a start whose job or GPUs changed
       since the state was read is skipped, not half-applied; the others get their
       attempts and allocations in a fixed number of queries. The (gpu, slot)
       unique constraint is the last line of defence.
    2. After commit, each started attempt's ``job.launch`` goes to its node.
    3. ``Preempt`` decisions ask the victims' nodes to stop them; ``Evict`` and
       ``QuotaStop`` too (``kill_reason`` "evicted", "quota").
    4. ``Wait`` decisions update the job's reason only when it changed.
    """
    result = ApplyResult()
    decisions = list(decisions)
    starts = [d for d in decisions if isinstance(d, policy.Start)]
    with transaction.atomic():
        t0 = time.perf_counter()
        result.started = start_jobs(starts, share_slots=policy_config().shares)
        result.skipped = len(starts) - result.started
        result.starts_ms = _ms_since(t0)
        t0 = time.perf_counter()
        for decision in decisions:
            if isinstance(decision, policy.Preempt) and _preempt(decision):
                result.preempted += 1
            elif isinstance(decision, policy.Evict) and _evict(decision):
                result.evicted += 1
            elif isinstance(decision, policy.QuotaStop) and _quota_stop(decision):
                result.quota_stopped += 1
        result.preempts_ms = _ms_since(t0)
        t0 = time.perf_counter()
        waits = [d for d in decisions if isinstance(d, policy.Wait)]
        if waits:
            result.updated_reasons = _update_reasons(waits, stored_waits)
        result.waits_ms = _ms_since(t0)
    return result


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _stop_for_scheduler(
    job_filter: Q, reason: protocol.KillReason, message: str
) -> tuple[Job, Attempt] | None:
    """Ask the node of a job on a node (matching ``job_filter``) to stop its live
    attempt for ``reason`` (SIGTERM, its grace, SIGKILL; a checkpointable job
    stopped to be requeued: its checkpoint signal and grace), with a job event; its exit
    then moves the job on (``finish_attempt``). A job being cancelled or already
    being stopped is left: None. Call inside a transaction."""
    job = (
        Job.objects.select_for_update()
        .filter(job_filter, status__in=Job.ON_NODE)
        .first()
    )
    if job is None or job.cancel_requested_at is not None:
        return None
    attempt = (
        Attempt.objects.select_for_update()
        .filter(job=job, ended_at__isnull=True)
        .first()
    )
    if attempt is None or attempt.kill_reason:
        return None
    attempt.kill_reason = reason
    attempt.save(update_fields=["kill_reason"])
    _event(job, message[:500], source=JobEvent.Source.SCHEDULER)
    grace, signal = kill_terms(job, reason)
    _send_kill_on_commit(attempt, reason, grace, signal=signal)
    return job, attempt


def _preempt(decision: policy.Preempt) -> bool:
    """Stop a preemption's victim; the job goes PREEMPTED -> PENDING when the
    agent reports the exit, with its submit time, hence its age, kept. Its
    attempt records the job it yields to (``Attempt.preempted_for``)."""
    with transaction.atomic():
        stopped = _stop_for_scheduler(
            Q(pk=decision.victim_id),
            "preempted",
            f"preempted for job #{decision.for_job_id}: {decision.reason}",
        )
        if stopped is None:
            return False
        _, attempt = stopped
        if Job.objects.filter(pk=decision.for_job_id).exists():
            attempt.preempted_for_id = decision.for_job_id
            attempt.save(update_fields=["preempted_for"])
    return True


def _quota_stop(decision: policy.QuotaStop) -> bool:
    """Stop a running job whose hard quota is used up (``GPULAB_QUOTA_OVERRUN``
    is "stop"); its exit ends it CANCELLED (``finish_attempt``), not requeued."""
    with transaction.atomic():
        return (
            _stop_for_scheduler(Q(pk=decision.job_id), "quota", decision.reason)
            is not None
        )


def _evict(decision: policy.Evict) -> bool:
    """Stop the later job of a pair measured over a cap and requeue it (its age
    kept), if its owner allowed that (the policy checked ``evictable`` too); a
    ``harmful`` pair is marked in the same transaction, so the next pass never
    admits it again until an admin resets it."""
    with transaction.atomic():
        stopped = _stop_for_scheduler(
            Q(pk=decision.job_id, evictable=True), "evicted", decision.reason
        )
        if stopped is None:
            return False
        if decision.harmful:
            mark_harmful(*decision.pair, reason=decision.reason)
    return True


WAIT_FIELDS = (
    "pending_reason",
    "pending_message",
    "queue_order",
    "priority_breakdown",
    "est_start",
)


# Rows another transaction holds (a job being started, cancelled or moved by a
# concurrent pass) are skipped, not waited for: their reason is moot or stale
# anyway, and an UPDATE that waits on rows in no set order can deadlock with a pass
# that locks jobs in id order (two passes raced in tests/scheduler/test_concurrency).
_UPDATE_WAITS = """
WITH v AS (
    SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::bigint[], %s::text[],
                         %s::timestamptz[])
        AS v(id, reason, message, order_key, breakdown, est_start)
), mine AS (
    SELECT j.id FROM scheduler_job AS j JOIN v ON v.id = j.id
    WHERE j.status = 'pending'
    FOR UPDATE OF j SKIP LOCKED
)
UPDATE scheduler_job AS j SET
    pending_reason = v.reason,
    pending_message = v.message,
    queue_order = v.order_key,
    priority_breakdown = v.breakdown::jsonb,
    est_start = v.est_start
FROM v JOIN mine ON mine.id = v.id
WHERE j.id = v.id
"""

_STORED_WAITS = """
SELECT id, pending_reason, pending_message, queue_order, priority_breakdown::text,
       extract(epoch FROM est_start)::float8
FROM scheduler_job WHERE status = 'pending' AND id = ANY(%s)
"""


def _update_reasons(
    waits: list[policy.Wait], stored: Mapping[int, StoredWait] | None = None
) -> int:
    """Store each waiting job's reason, order key, factors and planned start.

    Only rows that changed are written, in ONE statement (``UPDATE ... FROM
    unnest``): Django's ``bulk_update`` builds a CASE per field and row and takes
    a minute for 10,000 jobs. Factors are rounded to whole points (as the pages
    show them: at 0.1, the fair share moving with the running jobs' usage would
    rewrite a fifth of the waiting rows on every pass of a burst) and planned
    starts to the second, so a job's growing age does not rewrite every row on
    every pass; the order keys (``scheduler.queue_order``) change only where the
    order did, so a start does not rewrite the place of every job behind it (a
    stored place would rewrite 95 % of the waiting rows on each pass of a burst,
    bench/submit_burst.py).
    The stored values come from the pass's snapshot (or one query without it); a
    job no longer pending is left (the UPDATE checks too).
    """
    if stored is None:
        with connection.cursor() as cursor:
            cursor.execute(_STORED_WAITS, [[w.job_id for w in waits]])
            stored = {row[0]: row[1:] for row in cursor.fetchall()}
    placed = sorted((w for w in waits if w.position), key=attrgetter("position"))
    keys = queue_order.assign(
        [w.job_id for w in placed], {pk: old[2] for pk, old in stored.items()}
    )
    rows: list[tuple[Any, ...]] = []
    for wait in waits:
        old = stored.get(wait.job_id)
        if old is None:
            continue
        breakdown = {k: float(round(v)) for k, v in wait.breakdown.items()}
        est = round(wait.est_start) if wait.est_start is not None else None
        key = keys.get(wait.job_id, old[2]) if wait.position else None
        new = (wait.reason.value, wait.message[:500], key)
        # The scalars first: the stored breakdown is parsed only when they match.
        if new == old[:3] and est == old[4] and breakdown == json.loads(old[3]):
            continue
        rows.append((wait.job_id, *new, breakdown, None if est is None else _ts(est)))
    if not rows:
        return 0
    columns = list(zip(*rows, strict=True))
    with connection.cursor() as cursor:
        cursor.execute(
            _UPDATE_WAITS,
            [
                list(columns[0]),
                list(columns[1]),
                list(columns[2]),
                list(columns[3]),
                [json.dumps(b) for b in columns[4]],
                list(columns[5]),
            ],
        )
        return int(cursor.rowcount)
