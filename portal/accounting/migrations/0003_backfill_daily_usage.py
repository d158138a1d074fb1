"""Daily rows for the usage records written before ``DailyUsage`` existed, so the
Usage page is right for old periods.

Each record keeps its total (it is what was charged, by whatever rule was in
force then); its GPU-seconds are spread over its UTC days as the charging rule
spreads them (``charging.split`` over the runs on its GPU: a share that changed
at a neighbour's start or end moves seconds between days), or in proportion to
its time in each day when its GPU's runs are not all there any more. Energy and
busy time follow the seconds, as ``services.recharge`` writes them.

Idempotent: only records without a daily row are read, and rows are inserted
with ON CONFLICT DO NOTHING; a rerun (or a crash halfway, a batch being one
statement) finds nothing left or goes on.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import migrations

BATCH = 5000

_MISSING_SQL = """
SELECT r.id, r.gpu_id, r.user_id, r.group_id, t.job_id, r.attempt_id,
       date_part('epoch', r.started_at), date_part('epoch', r.ended_at),
       r.gpu_seconds, r.energy_j, r.util_gpu_mean
FROM scheduler_usagerecord r
JOIN scheduler_attempt t ON t.id = r.attempt_id
WHERE r.id > %s
  AND NOT EXISTS (SELECT 1 FROM accounting_dailyusage d WHERE d.record_id = r.id)
ORDER BY r.id
LIMIT %s
"""

_RUNS_SQL = """
SELECT DISTINCT w.gpu_id, t.id, date_part('epoch', t.started_at),
       date_part('epoch', t.ended_at), j.gpu_memory_mib, g.memory_total_mib
FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[])
     AS w(gpu_id, since, until)
JOIN scheduler_allocation a ON a.gpu_id = w.gpu_id
JOIN scheduler_attempt t ON t.id = a.attempt_id
JOIN scheduler_job j ON j.id = t.job_id
JOIN scheduler_gpu g ON g.id = a.gpu_id
WHERE t.started_at IS NOT NULL AND t.started_at <= w.until
  AND (t.ended_at IS NULL OR t.ended_at >= w.since)
"""

_INSERT_SQL = """
INSERT INTO accounting_dailyusage (record_id, day, user_id, group_id, job_id,
                                   gpu_seconds, energy_j, busy_gpu_seconds)
SELECT * FROM unnest(%s::bigint[], %s::date[], %s::int[], %s::bigint[],
                     %s::bigint[], %s::float8[], %s::float8[], %s::float8[])
ON CONFLICT (record_id, day) DO NOTHING
"""


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def by_time(start: float, end: float) -> dict[date, float]:
    """Seconds of [start, end] in each UTC day (one instant: its day)."""
    if end <= start:
        return {_dt(start).date(): 1.0}
    out: dict[date, float] = {}
    at = start
    while at < end:
        day = _dt(at).date()
        midnight = datetime.combine(day + timedelta(1), datetime.min.time(), UTC)
        step = min(end, midnight.timestamp())
        out[day] = out.get(day, 0.0) + step - at
        at = step
    return out


def spread(
    record: tuple[Any, ...], split: dict[int, dict[date, float]]
) -> dict[date, float]:
    """The record's GPU-seconds by UTC day: its split's shape, its own total."""
    _, _, _, _, _, attempt_id, start, end, seconds, _, _ = record
    shape = split.get(attempt_id) or {}
    if sum(shape.values()) <= 0:
        shape = by_time(float(start), float(end))
    total = sum(shape.values())
    return {day: float(seconds) * part / total for day, part in shape.items()}


def backfill(apps: Any, schema_editor: Any) -> None:
    from portal.accounting import charging  # pure: no models, no clock

    mode = getattr(settings, "GPULAB_SHARED_CHARGE", "memory")
    last = 0
    with schema_editor.connection.cursor() as cursor:
        while True:
            cursor.execute(_MISSING_SQL, [last, BATCH])
            records = cursor.fetchall()
            if not records:
                return
            last = records[-1][0]
            windows: dict[int, tuple[float, float]] = {}
            for r in records:
                lo, hi = windows.get(r[1], (float(r[6]), float(r[7])))
                windows[r[1]] = (min(lo, float(r[6])), max(hi, float(r[7])))
            gpus = sorted(windows)
            cursor.execute(
                _RUNS_SQL,
                [
                    gpus,
                    [_dt(windows[g][0]) for g in gpus],
                    [_dt(windows[g][1]) for g in gpus],
                ],
            )
            runs: dict[int, list[Any]] = defaultdict(list)
            for gpu_id, attempt_id, start, end, declared, memory in cursor.fetchall():
                runs[gpu_id].append(
                    charging.Run(
                        attempt_id,
                        float(start),
                        None if end is None else float(end),
                        charging.weight(mode, declared, memory),
                    )
                )
            splits = {g: charging.split(rs, windows[g][1]) for g, rs in runs.items()}
            rows: list[list[Any]] = [[] for _ in range(8)]
            for r in records:
                pk, gpu_id, user_id, group_id, job_id = r[:5]
                seconds, energy, util = r[8], r[9], r[10]
                for day, part in sorted(spread(r, splits.get(gpu_id, {})).items()):
                    share = part / seconds if seconds else 0.0
                    for column, value in zip(
                        rows,
                        (
                            pk,
                            day,
                            user_id,
                            group_id,
                            job_id,
                            part,
                            None if energy is None else energy * share,
                            None if util is None else part * util / 100.0,
                        ),
                        strict=True,
                    ):
                        column.append(value)
            cursor.execute(_INSERT_SQL, rows)


class Migration(migrations.Migration):
    dependencies = [
        ("accounting", "0002_gpu_hours"),
    ]

    operations = [
        migrations.RunPython(backfill, migrations.RunPython.noop, elidable=True),
    ]
