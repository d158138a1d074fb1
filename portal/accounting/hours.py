"""GPU time held and idle, per GPU and UTC hour (``GpuHour``): kept by beat's
``maintain_hours`` so the admin overview sums a few thousand rows instead of
joining every allocation of 30 days to the metric history (13.5 s at 100k jobs;
docs/architecture.md, "Admin console").

An hour is recomputed whole, from the sources, and replaces what was there:

- *held*: the agent-reported runs on the GPU (``charging.pieces``: the time the GPU
  ran at least one started attempt, a shared GPU's second once), a running
  attempt up to the end of the window (today counts up to the last run);
- *idle*: of that time, the share of each attempt whose own processes were idle
  by ``portal.idle.evidence`` (the rule the idle flags use): each persisted sample
  that is idle evidence for the attempt covers the time to the next sample of the
  GPU (one persist interval when the next is further than ``evidence.max_gap``: a
  gap is no evidence), and the attempt is charged its share of that time.

Which hours: from the earliest ``GpuHourStale`` mark (or ``LOOKBACK`` ago) to now,
in chunks of a day, each chunk one transaction that also replaces the marks it
read by one at its end. So a crash, a worker that was down or a run cut short by
its time budget leaves a mark where to go on, and a rerun recomputes rather than
adds. Marks also come from reports that change the past after it was computed
(``note_change``: an exit or a start reported late, a lost node's real exit,
samples replayed after a disconnect); the migration that made the table left one
``BACKFILL_DAYS`` back. Single-flight (a PostgreSQL advisory lock).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from portal.accounting import charging
from portal.accounting.models import GpuHour, GpuHourStale
from portal.idle import evidence
from portal.idle.rules import all_rules, rule_for

if TYPE_CHECKING:
    from collections.abc import Iterable

log = logging.getLogger(__name__)

# Recomputed on every run whatever the marks say: reports and samples arrive
# within seconds; older ones leave a mark (``note_change``).
LOOKBACK = timedelta(minutes=10)
CHUNK = timedelta(days=1)
# A run stops after the chunk that takes it past this; its mark says where to go on.
BUDGET_S = 60.0
# What the migration asks to backfill: the overview's 30 local days and a margin.
BACKFILL_DAYS = 31
LOCK_KEY = 0x6770_7533  # "gpu3"
HOUR = 3600.0


def request_recompute(since: datetime) -> None:
    """Have the next ``maintain`` recompute every hour from ``since`` on (e.g.
    after a change of the idle thresholds). In the caller's transaction."""
    GpuHourStale.objects.create(since=since)


def note_change(at: datetime, now: datetime | None = None) -> None:
    """A report changed the runs or samples from ``at`` on (an end, a start, a
    sample): ask for a recompute from there if it is older than what every run
    recomputes anyway. An insert, no lock: reports never wait on each other."""
    now = now or timezone.now()
    if at < now - LOOKBACK:
        request_recompute(at)


_RUNS_SQL = """
SELECT DISTINCT a.gpu_id, t.id, date_part('epoch', t.started_at),
       date_part('epoch', t.ended_at), j.gpu_memory_mib, g.memory_total_mib,
       j.priority_class
FROM scheduler_allocation a
JOIN scheduler_attempt t ON t.id = a.attempt_id
JOIN scheduler_job j ON j.id = t.job_id
JOIN scheduler_gpu g ON g.id = a.gpu_id
WHERE a.gpu_id = ANY(ARRAY(SELECT id FROM scheduler_gpu))
  AND (a.released_at IS NULL OR a.released_at > %(since)s)
  AND t.started_at IS NOT NULL AND t.started_at < %(until)s
  AND (t.ended_at IS NULL OR t.ended_at > %(since)s)
"""

# Each run's idle stretches in [since, until): the samples that are idle evidence
# for it (``evidence.own_sm`` under its threshold), each covering the time to the
# GPU's next sample (one persist interval after a gap), merged when they touch.
_IDLE_SQL = """
WITH r AS (
    SELECT * FROM unnest(%(attempts)s::bigint[], %(gpus)s::bigint[],
                         %(starts)s::timestamptz[], %(ends)s::timestamptz[],
                         %(thresholds)s::float8[])
        AS r(attempt_id, gpu_id, run_start, run_end, threshold)
), s AS (
    SELECT gpu_id, at, util_gpu, lost, processes,
           lead(at) OVER (PARTITION BY gpu_id ORDER BY at) AS next_at
    FROM scheduler_gpusample
    WHERE gpu_id = ANY(%(gpu_ids)s) AND at >= %(from)s AND at < %(until)s
), covered AS (
    SELECT r.attempt_id, r.gpu_id, greatest(s.at, %(since)s) AS a,
           least(CASE WHEN s.next_at - s.at <= %(max_gap)s THEN s.next_at
                      ELSE s.at + %(step)s END,
                 r.run_end, %(until)s) AS b
    FROM r JOIN s ON s.gpu_id = r.gpu_id
        AND s.at >= r.run_start AND s.at < r.run_end
    WHERE OWN_SM < r.threshold
), marked AS (
    SELECT *, CASE WHEN a <= lag(b) OVER w THEN 0 ELSE 1 END AS brk
    FROM covered WHERE b > a
    WINDOW w AS (PARTITION BY attempt_id, gpu_id ORDER BY a)
), islands AS (
    SELECT *, sum(brk) OVER (PARTITION BY attempt_id, gpu_id ORDER BY a) AS island
    FROM marked
)
SELECT attempt_id, gpu_id, date_part('epoch', min(a)), date_part('epoch', max(b))
FROM islands GROUP BY attempt_id, gpu_id, island
""".replace("OWN_SM", evidence.own_sm("s", "r.attempt_id"))


def _epoch(moment: datetime) -> float:
    return moment.timestamp()


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _merge(spans: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted, disjoint starts and ends of the union of ``spans``."""
    starts: list[float] = []
    ends: list[float] = []
    for a, b in sorted(spans):
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def _inside(spans: tuple[list[float], list[float]] | None, at: float) -> bool:
    if spans is None:
        return False
    starts, ends = spans
    i = bisect.bisect_right(starts, at) - 1
    return i >= 0 and at < ends[i]


def compute(since: datetime, until: datetime) -> dict[tuple[int, float], list[float]]:
    """Held and idle seconds per (GPU, hour start as epoch seconds) in [since,
    until) (``since`` on an hour). Two queries: the runs, their idle stretches."""
    lo, hi = _epoch(since), _epoch(until)
    with connection.cursor() as cursor:
        cursor.execute(_RUNS_SQL, {"since": since, "until": until})
        rows = cursor.fetchall()
    if not rows:
        return {}
    rules = all_rules()
    mode = settings.GPULAB_SHARED_CHARGE
    runs: dict[int, list[charging.Run]] = defaultdict(list)
    for gpu_id, attempt_id, start, end, declared, memory, _ in rows:
        runs[gpu_id].append(
            charging.Run(
                attempt_id,
                max(float(start), lo),  # clipped: shares after it do not change
                None if end is None else float(end),
                charging.weight(mode, declared, memory),
            )
        )
    gap, step = evidence.max_gap(), evidence.step()
    params: dict[str, Any] = {
        "attempts": [r[1] for r in rows],
        "gpus": [r[0] for r in rows],
        "starts": [_dt(float(r[2])) for r in rows],
        "ends": [until if r[3] is None else _dt(float(r[3])) for r in rows],
        "thresholds": [rule_for(rules, r[6]).threshold for r in rows],
        "gpu_ids": sorted(runs),
        "from": since - gap,
        "since": since,
        "until": until,
        "max_gap": gap,
        "step": step,
    }
    with connection.cursor() as cursor:
        cursor.execute(_IDLE_SQL, params)
        stretches: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
        for attempt_id, gpu_id, a, b in cursor.fetchall():
            stretches[attempt_id, gpu_id].append((float(a), float(b)))
    idle = {key: _merge(spans) for key, spans in stretches.items()}
    hour_marks = _hour_marks(lo, hi)
    out: dict[tuple[int, float], list[float]] = {}
    for gpu_id, gpu_runs in runs.items():
        cuts = list(hour_marks)
        for run in gpu_runs:
            spans = idle.get((run.attempt_id, gpu_id))
            if spans is not None:
                cuts.extend(spans[0])
                cuts.extend(spans[1])
        for t0, t1, shares in charging.pieces(gpu_runs, hi, cuts):
            if t1 <= lo:
                continue
            hour = (t0 // HOUR) * HOUR
            mid = (t0 + t1) / 2
            idle_share = sum(
                share
                for attempt_id, share in shares.items()
                if _inside(idle.get((attempt_id, gpu_id)), mid)
            )
            figures = out.setdefault((gpu_id, hour), [0.0, 0.0])
            figures[0] += t1 - t0
            figures[1] += (t1 - t0) * idle_share
    return out


def _hour_marks(lo: float, hi: float) -> list[float]:
    first = (lo // HOUR + 1) * HOUR
    return [first + i * HOUR for i in range(int((hi - first) // HOUR) + 1)]


_DELETE_SQL = """
DELETE FROM accounting_gpuhour h
WHERE h.start >= %(since)s AND h.start < %(until)s
  AND (h.gpu_id, h.start) NOT IN (
      SELECT * FROM unnest(%(gpus)s::bigint[], %(starts)s::timestamptz[]))
"""
# An hour whose samples are gone (past GPULAB_METRICS_RETENTION_DAYS) keeps the
# idle time computed while they were there.
_UPSERT_SQL = """
INSERT INTO accounting_gpuhour (gpu_id, start, held_seconds, idle_seconds)
SELECT * FROM unnest(%(gpus)s::bigint[], %(starts)s::timestamptz[],
                     %(held)s::float8[], %(idle)s::float8[])
ON CONFLICT (gpu_id, start) DO UPDATE SET
    held_seconds = EXCLUDED.held_seconds,
    idle_seconds = CASE WHEN EXCLUDED.start >= %(evidence_since)s
                        THEN EXCLUDED.idle_seconds
                        ELSE accounting_gpuhour.idle_seconds END
"""


def evidence_since(now: datetime) -> datetime:
    """The oldest moment whose samples are still kept: the start of the oldest
    daily partition retention keeps (``scheduler.metrics``)."""
    day = now.astimezone(UTC).date() - timedelta(
        days=settings.GPULAB_METRICS_RETENTION_DAYS
    )
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def write(
    since: datetime,
    until: datetime,
    figures: dict[tuple[int, float], list[float]],
    now: datetime,
) -> int:
    """Replace the rows of [since, until) by ``figures``. Returns rows written."""
    keys = sorted(figures)
    kept = evidence_since(now).timestamp()
    params: dict[str, Any] = {
        "since": since,
        "until": until,
        "gpus": [g for g, _ in keys],
        "starts": [_dt(h) for _, h in keys],
        "held": [figures[k][0] for k in keys],
        "idle": [figures[k][1] if k[1] >= kept else None for k in keys],
        "evidence_since": _dt(kept),
    }
    with connection.cursor() as cursor:
        cursor.execute(_DELETE_SQL, params)
        if keys:
            cursor.execute(_UPSERT_SQL, params)
    return len(keys)


def _floor(moment: datetime, width: timedelta) -> datetime:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return epoch + ((moment - epoch) // width) * width


def maintain(now: datetime | None = None) -> dict[str, Any]:
    """Recompute the stale hours up to the last whole minute (beat, every
    minute, in ``tasks.maintain_hours``), drop rows past ``GPULAB_ROLLUP_1H_DAYS``."""
    now = now or timezone.now()
    until = _floor(now, timedelta(minutes=1))
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [LOCK_KEY])
        if not cursor.fetchone()[0]:
            return {"gpu_hours": "another run is under way"}
    try:
        marks = list(GpuHourStale.objects.values_list("pk", "since"))
        oldest = until - timedelta(days=settings.GPULAB_ROLLUP_1H_DAYS)
        start = max(oldest, min([s for _, s in marks] + [until - LOOKBACK]))
        at = _floor(start, timedelta(hours=1))
        ids = [pk for pk, _ in marks]
        began, rows, chunks = time.monotonic(), 0, 0
        while at < until:
            end = min(at + CHUNK, until)
            with transaction.atomic():
                rows += write(at, end, compute(at, end), now)
                GpuHourStale.objects.filter(pk__in=ids).delete()
                ids = [GpuHourStale.objects.create(since=end).pk]
            at, chunks = end, chunks + 1
            if time.monotonic() - began > BUDGET_S:
                break
        dropped, _ = GpuHour.objects.filter(
            start__lt=now - timedelta(days=settings.GPULAB_ROLLUP_1H_DAYS)
        ).delete()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])
    if at < until:
        log.info("GPU hours: recomputed up to %s; the next run goes on", at)
    return {
        "gpu_hours_from": start.isoformat(),
        "gpu_hours_through": at.isoformat(),
        "gpu_hour_rows": rows,
        "gpu_hour_chunks": chunks,
        "gpu_hours_dropped": dropped,
    }


def through() -> datetime | None:
    """Up to when the hours are computed: where the last run stopped (the latest
    mark; None before any run)."""
    latest = GpuHourStale.objects.order_by("-since").values_list("since", flat=True)
    return latest.first()
