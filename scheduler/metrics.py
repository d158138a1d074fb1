"""GPU metric history: the day-partitioned sample table, rollups and retention.

Data path: the agent samples every second; the consumer keeps the 1 Hz stream live
(latest state, dashboards) and persists one sample per GPU every
``GPULAB_METRICS_PERSIST_INTERVAL`` seconds (``should_persist``) through
``store_samples``. The ``maintain_metrics`` beat task rolls samples up to 1-minute and
1-hour min/mean/max, creates tomorrow's partitions and drops partitions older than
``GPULAB_METRICS_RETENTION_DAYS`` (whole tables, no row deletes).

History reads are one indexed query each: ``gpu_history`` (a GPU's samples or
rollups, by range) and ``job_history`` (the samples of the GPUs a job held, while it
held them).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from scheduler import hooks

if TYPE_CHECKING:
    from agents import protocol

log = logging.getLogger(__name__)

TABLE = "scheduler_gpusample"
_PARTITION_RE = re.compile(rf"^{TABLE}_p(\d{{8}})$")
# A sample further in the future than this is refused (an agent with a wrong clock).
MAX_CLOCK_SKEW = timedelta(hours=1)


def _partition_name(day: date) -> str:
    return f"{TABLE}_p{day:%Y%m%d}"


def ensure_partitions(cursor: Any, now: datetime | None = None) -> list[str]:
    """Make sure the daily partitions exist from the start of the retention window to
    two days ahead; return their names. Idempotent (IF NOT EXISTS)."""
    now = now or datetime.now(tz=UTC)
    today = now.astimezone(UTC).date()
    first = today - timedelta(days=settings.GPULAB_METRICS_RETENTION_DAYS)
    created = []
    day = first
    while day <= today + timedelta(days=2):
        name = _partition_name(day)
        start = datetime(day.year, day.month, day.day, tzinfo=UTC)
        end = start + timedelta(days=1)
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {TABLE} "
            "FOR VALUES FROM (%s) TO (%s)",
            [start, end],
        )
        created.append(name)
        day += timedelta(days=1)
    return created


def partitions(cursor: Any) -> list[tuple[str, date]]:
    cursor.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s",
        [TABLE],
    )
    found = []
    for (name,) in cursor.fetchall():
        match = _PARTITION_RE.match(name)
        if match:
            found.append((name, datetime.strptime(match.group(1), "%Y%m%d").date()))
    return sorted(found, key=lambda p: p[1])


def drop_old_partitions(cursor: Any, now: datetime | None = None) -> list[str]:
    """Drop the partitions wholly older than the retention window."""
    now = now or datetime.now(tz=UTC)
    oldest_kept = now.astimezone(UTC).date() - timedelta(
        days=settings.GPULAB_METRICS_RETENTION_DAYS
    )
    dropped = []
    for name, day in partitions(cursor):
        if day < oldest_kept:
            cursor.execute(f"DROP TABLE IF EXISTS {name}")
            dropped.append(name)
    return dropped


# ------------------------------------------------------------------ ingest


def should_persist(last: float | None, sampled_at: float) -> bool:
    """Whether a sample taken at ``sampled_at`` starts a new persistence interval
    after the last persisted one (per connection, all GPUs of a node at once)."""
    interval = settings.GPULAB_METRICS_PERSIST_INTERVAL
    if last is None:
        return True
    return int(sampled_at // interval) != int(last // interval)


@dataclass(frozen=True)
class StoreResult:
    stored: int
    refused: int


def store_samples(
    gpu_ids: dict[int, int], metrics: protocol.MetricsData, now: datetime | None = None
) -> StoreResult:
    """Insert one row per GPU of ``metrics`` (``gpu_ids``: index -> Gpu id).

    A replayed sample (same GPU and ``sampled_at``) is ignored by the primary key;
    samples older than the retention window or too far in the future are refused.
    """
    return store_samples_many([(gpu_ids, metrics)], now)


def store_samples_many(
    frames: list[tuple[dict[int, int], protocol.MetricsData]],
    now: datetime | None = None,
) -> StoreResult:
    """``store_samples`` for many frames (of many nodes) in one statement."""
    now = now or timezone.now()
    oldest = now - timedelta(days=settings.GPULAB_METRICS_RETENTION_DAYS)
    rows: list[dict[str, Any]] = []
    refused = 0
    earliest: datetime | None = None
    for gpu_ids, metrics in frames:
        at = datetime.fromtimestamp(metrics.sampled_at, tz=UTC)
        if at < oldest or at > now + MAX_CLOCK_SKEW:
            refused += len(metrics.gpus)
            continue
        before = len(rows)
        stamp = at.isoformat()
        for s in metrics.gpus:
            gpu_id = gpu_ids.get(s.index)
            if gpu_id is None:
                continue
            rows.append(
                {
                    "gpu_id": gpu_id,
                    "at": stamp,
                    **s.model_dump(include=_SAMPLE_FIELDS),
                    "processes": [p.model_dump(mode="json") for p in s.processes],
                }
            )
        if len(rows) > before and (earliest is None or at < earliest):
            earliest = at
    if not rows:
        return StoreResult(0, refused)
    _insert(rows)
    # A sample replayed late (after a disconnect) changes idle time the GPU-hour
    # rollup may have computed already: have it look again from there.
    assert earliest is not None
    hooks.accounting().samples_changed(earliest, now)
    return StoreResult(len(rows), refused)


# A stored sample's columns and their types, in the table's order: gpu_id, at,
# then the ``GpuSample`` fields of the same names, then its processes.
SAMPLE_COLUMNS = (
    ("gpu_id", "bigint"), ("at", "timestamptz"), ("util_gpu", "float8"),
    ("util_mem", "float8"), ("memory_used_mib", "int"), ("temperature_c", "float8"),
    ("power_w", "float8"), ("sm_clock_mhz", "int"), ("pcie_rx_kib_s", "bigint"),
    ("pcie_tx_kib_s", "bigint"), ("ecc_uncorrected", "bigint"),
    ("energy_mj", "bigint"), ("lost", "bool"), ("processes", "jsonb"),
)  # fmt: skip
_SAMPLE_FIELDS = {name for name, _ in SAMPLE_COLUMNS[2:-1]}
_NAMES = ", ".join(name for name, _ in SAMPLE_COLUMNS)

# Every row of a batch in one statement, the rows as one JSON document that
# PostgreSQL takes apart (a statement per row costs a round trip and a parse per
# GPU sample; one array parameter per column costs the web process about 30 us of
# CPU per GPU to quote: psycopg dumps arrays element by element).
_INSERT = (
    f"INSERT INTO {TABLE} ({_NAMES}) SELECT {_NAMES} FROM jsonb_to_recordset(%s::jsonb)"
    f" AS r({', '.join(f'{name} {kind}' for name, kind in SAMPLE_COLUMNS)})"
    " ON CONFLICT (gpu_id, at) DO NOTHING"
)


def _insert(rows: list[dict[str, Any]]) -> None:
    document = json.dumps(rows)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(_INSERT, [document])
    except Exception as exc:
        # No partition for that day (beat has not run for days): create, retry once.
        if "no partition of relation" not in str(exc):
            raise
        with connection.cursor() as cursor:
            ensure_partitions(cursor)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(_INSERT, [document])


# ------------------------------------------------------------------ rollups

_INSERT_ROLLUP = """
INSERT INTO scheduler_gpurollup (gpu_id, resolution, start, samples,
    util_gpu_min, util_gpu_mean, util_gpu_max, util_mem_mean,
    memory_used_mean, memory_used_max, power_mean, power_max,
    temperature_mean, temperature_max)
"""
# Re-running a rollup over the same window replaces its rows (idempotent).
_UPSERT = """
ON CONFLICT (gpu_id, resolution, start) DO UPDATE SET
    samples = EXCLUDED.samples,
    util_gpu_min = EXCLUDED.util_gpu_min, util_gpu_mean = EXCLUDED.util_gpu_mean,
    util_gpu_max = EXCLUDED.util_gpu_max, util_mem_mean = EXCLUDED.util_mem_mean,
    memory_used_mean = EXCLUDED.memory_used_mean,
    memory_used_max = EXCLUDED.memory_used_max,
    power_mean = EXCLUDED.power_mean, power_max = EXCLUDED.power_max,
    temperature_mean = EXCLUDED.temperature_mean,
    temperature_max = EXCLUDED.temperature_max
"""

_ROLLUP_SQL = (
    _INSERT_ROLLUP
    + """
SELECT gpu_id, %(resolution)s, date_bin(%(width)s::interval, at, TIMESTAMPTZ 'epoch'),
    count(*), min(util_gpu), avg(util_gpu), max(util_gpu), avg(util_mem),
    avg(memory_used_mib), max(memory_used_mib), avg(power_w), max(power_w),
    avg(temperature_c), max(temperature_c)
FROM scheduler_gpusample
WHERE at >= %(since)s AND at < %(until)s
GROUP BY 1, 3
"""
    + _UPSERT
)

# The hour rollup is built from minute rollups, weighting each by its sample count.
_ROLLUP_HOUR_SQL = (
    _INSERT_ROLLUP
    + """
SELECT gpu_id, '1h', date_bin('1 hour'::interval, start, TIMESTAMPTZ 'epoch'),
    sum(samples), min(util_gpu_min),
    sum(util_gpu_mean * samples) / nullif(sum(samples) FILTER (
        WHERE util_gpu_mean IS NOT NULL), 0),
    max(util_gpu_max),
    sum(util_mem_mean * samples) / nullif(sum(samples) FILTER (
        WHERE util_mem_mean IS NOT NULL), 0),
    sum(memory_used_mean * samples) / nullif(sum(samples) FILTER (
        WHERE memory_used_mean IS NOT NULL), 0),
    max(memory_used_max),
    sum(power_mean * samples) / nullif(sum(samples) FILTER (
        WHERE power_mean IS NOT NULL), 0),
    max(power_max),
    sum(temperature_mean * samples) / nullif(sum(samples) FILTER (
        WHERE temperature_mean IS NOT NULL), 0),
    max(temperature_max)
FROM scheduler_gpurollup
WHERE resolution = '1m' AND start >= %(since)s AND start < %(until)s
GROUP BY 1, 3
"""
    + _UPSERT
)


def _floor(moment: datetime, width: timedelta) -> datetime:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return epoch + ((moment - epoch) // width) * width


def rollup(now: datetime | None = None, lookback: timedelta | None = None) -> int:
    """(Re)compute the minute rollups of closed minutes in the lookback window, then
    the hour rollups of the hours they touch. Idempotent (upserts), so a sample
    replayed late into a closed minute is folded in by the next run. Returns rows."""
    now = now or timezone.now()
    lookback = lookback or timedelta(hours=2)
    until_m = _floor(now, timedelta(minutes=1))
    since_m = _floor(now - lookback, timedelta(minutes=1))
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            _ROLLUP_SQL,
            {
                "resolution": "1m",
                "width": "1 minute",
                "since": since_m,
                "until": until_m,
            },
        )
        rows = cursor.rowcount
        since_h = _floor(since_m, timedelta(hours=1))
        cursor.execute(_ROLLUP_HOUR_SQL, {"since": since_h, "until": until_m})
        rows += cursor.rowcount
    return int(rows)


def drop_old_rollups(now: datetime | None = None) -> int:
    from scheduler.models import GpuRollup

    now = now or timezone.now()
    minute_cut = now - timedelta(days=settings.GPULAB_ROLLUP_1M_DAYS)
    hour_cut = now - timedelta(days=settings.GPULAB_ROLLUP_1H_DAYS)
    deleted, _ = GpuRollup.objects.filter(
        resolution=GpuRollup.Resolution.MINUTE, start__lt=minute_cut
    ).delete()
    more, _ = GpuRollup.objects.filter(
        resolution=GpuRollup.Resolution.HOUR, start__lt=hour_cut
    ).delete()
    return deleted + more


def maintain(now: datetime | None = None) -> dict[str, Any]:
    """The beat task's body: partitions ahead, rollups, retention."""
    now = now or timezone.now()
    with connection.cursor() as cursor:
        ensure_partitions(cursor, now)
        dropped = drop_old_partitions(cursor, now)
    rolled = rollup(now)
    old_rollups = drop_old_rollups(now)
    return {
        "dropped_partitions": dropped,
        "rollup_rows": rolled,
        "dropped_rollups": old_rollups,
    }


# ------------------------------------------------------------------ reads

SAMPLE_FIELDS = (
    "at",
    "util_gpu",
    "util_mem",
    "memory_used_mib",
    "temperature_c",
    "power_w",
    "processes",
)


def resolution_for(span: timedelta) -> str:
    """Raw samples for short ranges, minute rollups up to two days, hours beyond;
    ranges older than raw retention always read rollups."""
    if span <= timedelta(hours=1):
        return "raw"
    if span <= timedelta(days=2):
        return "1m"
    return "1h"


def gpu_history(
    gpu_id: int, since: datetime, until: datetime | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """A GPU's history in one indexed query at the resolution that suits the range."""
    from scheduler.models import GpuRollup, GpuSample

    until = until or timezone.now()
    resolution = resolution_for(until - since)
    raw_start = timezone.now() - timedelta(days=settings.GPULAB_METRICS_RETENTION_DAYS)
    if resolution == "raw" and since < raw_start:
        resolution = "1m"
    if resolution == "raw":
        rows = list(
            GpuSample.objects.filter(gpu_id=gpu_id, at__gte=since, at__lte=until)
            .order_by("at")
            .values(*SAMPLE_FIELDS)
        )
        return resolution, rows
    rollups = GpuRollup.objects.filter(
        gpu_id=gpu_id, resolution=resolution, start__gte=since, start__lte=until
    ).order_by("start")
    return resolution, [dict(row) for row in rollups.values()]


def job_history(job_id: int, since: datetime | None = None) -> list[dict[str, Any]]:
    """The samples of every GPU the job held, while it held it (from ``since``
    when given), in one query. A GPU counts once per attempt: the attempt's
    lowest slot on it (an exclusive job holds every slot, a job that joined a
    shared GPU holds a slot above 0)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT DISTINCT s.gpu_id, s.at, s.util_gpu, s.util_mem, s.memory_used_mib,
                   s.temperature_c, s.power_w, s.processes, t.id AS attempt_id
            FROM {TABLE} s
            JOIN scheduler_allocation a ON a.gpu_id = s.gpu_id AND a.slot = (
                SELECT min(b.slot) FROM scheduler_allocation b
                WHERE b.attempt_id = a.attempt_id AND b.gpu_id = a.gpu_id
            )
            JOIN scheduler_attempt t ON t.id = a.attempt_id
            WHERE t.job_id = %s
              AND s.at >= COALESCE(t.started_at, a.allocated_at)
              AND s.at <= COALESCE(t.ended_at, now())
              AND s.at >= %s
            ORDER BY s.at, s.gpu_id
            """,
            [job_id, since or datetime(1970, 1, 1, tzinfo=UTC)],
        )
        names = [c.name for c in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    for row in rows:
        # Django has psycopg hand jsonb over as text.
        if isinstance(row["processes"], str):
            row["processes"] = json.loads(row["processes"])
    return rows


# ------------------------------------------------------------------ chart series

# The dashboards' ranges, and the bucket of the per-process series at each
# resolution (raw: one point per persisted sample).
RANGES: dict[str, timedelta] = {
    "15m": timedelta(minutes=15),
    "6h": timedelta(hours=6),
    "7d": timedelta(days=7),
}
_BUCKETS = {"raw": None, "1m": "1 minute", "1h": "1 hour"}


class BadRange(ValueError):
    """A range the dashboards do not offer; ``str()`` says which ones they do."""


def parse_range(value: str | None) -> tuple[str, timedelta]:
    """``15m`` (the default), ``6h`` or ``7d``."""
    name = value or "15m"
    if name not in RANGES:
        raise BadRange(f"unknown range {name[:20]!r}: use one of {', '.join(RANGES)}")
    return name, RANGES[name]


def gpus_series(
    gpu_ids: list[int], since: datetime, until: datetime
) -> tuple[str, dict[int, dict[str, list[Any]]]]:
    """Utilisation, memory, power and temperature of several GPUs over a range, at
    the resolution ``gpu_history`` would pick, in one indexed query (the sample
    table's primary key, or the rollups' unique index). Returns the resolution and
    per GPU id the columns ``t`` (epoch seconds), ``util``, ``mem``, ``power``,
    ``temp`` (rollups: the means)."""
    resolution = resolution_for(until - since)
    raw_start = timezone.now() - timedelta(days=settings.GPULAB_METRICS_RETENTION_DAYS)
    if resolution == "raw" and since < raw_start:
        resolution = "1m"
    if resolution == "raw":
        sql = f"""
            SELECT gpu_id, at, util_gpu, memory_used_mib, power_w, temperature_c
            FROM {TABLE}
            WHERE gpu_id = ANY(%s) AND at >= %s AND at <= %s
            ORDER BY gpu_id, at
        """
        params: list[Any] = [gpu_ids, since, until]
    else:
        sql = """
            SELECT gpu_id, start, util_gpu_mean, memory_used_mean, power_mean,
                   temperature_mean
            FROM scheduler_gpurollup
            WHERE gpu_id = ANY(%s) AND resolution = %s AND start >= %s
              AND start <= %s
            ORDER BY gpu_id, start
        """
        params = [gpu_ids, resolution, since, until]
    out: dict[int, dict[str, list[Any]]] = {
        g: {"t": [], "util": [], "mem": [], "power": [], "temp": []} for g in gpu_ids
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for gpu_id, at, util, mem, power, temp in cursor.fetchall():
            col = out[gpu_id]
            col["t"].append(at.timestamp())
            col["util"].append(_r(util))
            col["mem"].append(_r(mem))
            col["power"].append(_r(power))
            col["temp"].append(_r(temp))
    return resolution, out


def _r(value: Any) -> float | None:
    return None if value is None else round(float(value), 1)


def process_series(
    gpu_ids: list[int], since: datetime, until: datetime, resolution: str
) -> list[dict[str, Any]]:
    """GPU memory held by each process owner over a range: per GPU, per attempt
    (a job's processes together) or per foreign pid, the most it held in each
    bucket of ``resolution``. Raw samples only (rollups keep no processes), so
    within the raw retention; one query over the sample table's primary key.
    Each series: ``gpu``, ``attempt`` (None: foreign), ``pid`` (foreign only),
    ``t``, ``mib``."""
    bucket = _BUCKETS.get(resolution)
    width = f"'{bucket}'::interval" if bucket else None
    at = f"date_bin({width}, s.at, TIMESTAMPTZ 'epoch')" if width else "s.at"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT s.gpu_id, {at} AS b, (p->>'attempt_id')::bigint AS attempt,
                   CASE WHEN p->>'attempt_id' IS NULL THEN (p->>'pid')::bigint END,
                   max((p->>'used_memory_mib')::bigint)
            FROM {TABLE} s, jsonb_array_elements(s.processes) p
            WHERE s.gpu_id = ANY(%s) AND s.at >= %s AND s.at <= %s
            GROUP BY 1, 2, 3, 4
            ORDER BY 1, 3, 4, 2
            """,
            [gpu_ids, since, until],
        )
        series: dict[tuple[int, int | None, int | None], dict[str, Any]] = {}
        for gpu_id, b, attempt, pid, mib in cursor.fetchall():
            key = (gpu_id, attempt, pid)
            one = series.setdefault(
                key,
                {"gpu": gpu_id, "attempt": attempt, "pid": pid, "t": [], "mib": []},
            )
            one["t"].append(b.timestamp())
            one["mib"].append(None if mib is None else int(mib))
    return list(series.values())
