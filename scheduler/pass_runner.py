"""The scheduling pass runner: load the state, decide, apply, one pass at a time.

Above ``scheduler.services`` (it calls ``snapshot`` and ``apply_decisions``) and
below ``scheduler.tasks`` (whose ``schedule_pass`` is a thin adapter around
``schedule_pass_body``). Each pass's statistics go to ``scheduler.pass_log``;
the quota alerts hear of each applied pass through ``hooks.quotas()``.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection

from scheduler import hooks, live, policy, services
from scheduler.pass_log import PassRecord, keep
from scheduler.pass_requests import _queued_key, _redis_client, _rerun_key

if TYPE_CHECKING:
    from collections.abc import Iterator

# Key of the PostgreSQL advisory lock that makes the scheduling pass single-flight.
SCHEDULE_LOCK_KEY = 0x6770_7531  # "gpu1"
# How many times one task may loop on "rerun requested" before leaving the rest to
# the next trigger (bounded work per task).
MAX_LOOPS = 20


def _try_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [SCHEDULE_LOCK_KEY])
        return bool(cursor.fetchone()[0])


def _unlock() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(%s)", [SCHEDULE_LOCK_KEY])


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector for one pass, then restore it as it was.

    A pass at 10,000 pending jobs builds some 100,000 objects that all live until
    it ends: left on, the collector's thresholds keep tripping and it walks them
    (and the rest of the heap) over and over, ~130 ms of CPU a pass
    (bench/pass_scaling.py).
    Reference counting frees everything as usual; a cycle made meanwhile waits for
    the first collection after the pass. Concurrent passes (threads) leave it as
    they found it: only the one that paused it resumes it.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def run_one_pass() -> dict[str, Any]:
    """Load the state, decide (``policy.run_pass``), apply, record the quota
    alerts due; keep the pass's statistics (``pass_log.keep``). Returns figures
    for the caller's log and bench/pass_scaling.py."""
    at = time.time()
    with _cyclic_gc_paused():
        t0 = time.perf_counter()
        snapshot = services.snapshot()
        t1 = time.perf_counter()
        result = policy.run_pass(snapshot.cluster)
        t2 = time.perf_counter()
        # The waits' stored reasons came with the snapshot: not read a second time.
        applied = services.apply_decisions(result.decisions, snapshot.stored_waits)
        # Quota alerts (80 %, 100 %): one insert, only when one is due.
        alerts = hooks.quotas().pass_applied(snapshot.quotas)
        t3 = time.perf_counter()
    if applied.started or applied.updated_reasons:
        # Positions or reasons changed: the queue's pages fetch it again.
        live.mark_queue_changed()
    keep(
        PassRecord.of(
            result.stats,
            at=at,
            load_s=t1 - t0,
            decide_s=t2 - t1,
            apply_s=t3 - t2,
            total_s=t3 - t0,
        )
    )
    return {
        "pending": len(snapshot.cluster.pending),
        "started": applied.started,
        "skipped": applied.skipped,
        "reasons_updated": applied.updated_reasons,
        "quota_stopped": applied.quota_stopped,
        "quota_alerts": alerts,
        "stop_reason": result.stats.stop_reason,
        "ms": round((t3 - t0) * 1000, 1),
        # Where the pass's time went (bench/pass_scaling.py prints these).
        "ms_state": round((t1 - t0) * 1000, 1),
        "ms_decide": round((t2 - t1) * 1000, 1),
        "ms_apply": round((t3 - t2) * 1000, 1),
        "ms_starts": round(applied.starts_ms, 1),
        "ms_preempts": round(applied.preempts_ms, 1),
        "ms_waits": round(applied.waits_ms, 1),
    }


def schedule_pass_body() -> dict[str, Any]:
    """One single-flight scheduling run.

    1. Take the advisory lock without waiting. If another pass holds it, set the
       "rerun requested" flag, so the running pass loops once more, and return.
    2. Clear the flag and the "pass queued" mark (``claim_pass_request``; a task
       that found the lock taken leaves the mark: the holder's next pass covers
       the requests it stands for, and they enqueue no more tasks), run a pass;
       loop while the flag was set again meanwhile, each further pass starting
       ``GPULAB_PASS_MIN_SPACING`` s at the earliest after the previous one
       started, and no sooner after it ended than it took (``_space_after``):
       under a burst of submissions the passes (each loading the whole queue and
       storing the waits' reasons) would otherwise run back to back and hold the
       database's cores from the pages. A first pass never waits, so an idle
       cluster starts a job at once.
    3. Release the lock, then look at the flag once more: a request that arrived
       between the last check and the release would otherwise be lost.
    The lock is session-level: if the worker dies, PostgreSQL drops it with the
    connection, and each pass's writes are one transaction, so nothing is half-applied.
    """
    flags = _redis_client()
    key = _rerun_key()
    passes: list[dict[str, Any]] = []
    started: float | None = None  # when the last pass started
    ended = 0.0  # and when it ended
    for _ in range(MAX_LOOPS):
        if not _try_lock():
            flags.set(key, "1")
            return {"skipped": "another pass is running", "passes": passes}
        try:
            while len(passes) < MAX_LOOPS:
                if started is not None:
                    _space_after(started, ended)
                started = time.monotonic()
                # About to load the state: a change committed from now on asks
                # for a pass of its own (claim_pass_request).
                flags.delete(key, _queued_key())
                passes.append(run_one_pass())
                ended = time.monotonic()
                if not flags.exists(key):
                    break
        finally:
            _unlock()
        if not flags.exists(key) or len(passes) >= MAX_LOOPS:
            break
    return {"passes": passes}


def _space_after(started: float, ended: float) -> None:
    """Wait until ``GPULAB_PASS_MIN_SPACING`` s after the last pass started, and at
    least as long after it ended as it took: passes hold at most half of the time.
    A pass over thousands of waiting jobs takes 1-2 s, and back to back under a
    job's churn the passes would keep the pages waiting on the database."""
    resume = max(started + settings.GPULAB_PASS_MIN_SPACING, ended + (ended - started))
    wait = resume - time.monotonic()
    if wait > 0:
        time.sleep(wait)
