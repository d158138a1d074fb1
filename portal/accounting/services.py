"""Charging GPU time: the only writer of ``UsageRecord`` and ``DailyUsage``.

``charge(attempt)`` runs in the transaction that ends an attempt
(``scheduler.services.lifecycle.end_attempt``, from the agent's exit, a lost
node or a given-up launch); ``recharge_after_start(attempt)`` in the one that
records a start reported after a neighbour on its GPU already ended (a late
report). Both recompute, on the attempt's GPUs, every ended attempt whose run
overlaps the one that changed, from the agent-reported times of all the runs
there (``charging.split_parts``). So the charges depend only on the runs' final
times (and where a requeued attempt's lost work starts, ``Attempt.lost_since``,
saved before its end is charged), not on the order their reports arrived in:
exits replayed after a reconnect, in any order, end with the same charges as if
reported live.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from django.conf import settings
from django.db import connection
from django.utils import timezone

from portal.accounting import charging, hours
from portal.accounting.models import DailyUsage
from scheduler.models import Allocation, Attempt, Gpu, UsageRecord

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Sequence


class RunRow(NamedTuple):
    """An attempt's run on one GPU, as loaded (times as epoch seconds)."""

    gpu_id: int
    attempt_id: int
    start: float
    end: float | None
    declared_mib: int | None
    gpu_memory_mib: int
    user_id: int
    group_id: int
    job_id: int
    lost_from: float | None = None  # ``Attempt.lost_since``

    @classmethod
    def from_row(cls, r: Sequence[Any]) -> RunRow:
        """From a row of the run queries' columns (``_RUNS_SQL``, ``live._SQL``):
        gpu, attempt, start and end epochs, declared and total memory, owner,
        group, job, where its lost work starts."""
        return cls(
            gpu_id=r[0],
            attempt_id=r[1],
            start=float(r[2]),
            end=None if r[3] is None else float(r[3]),
            declared_mib=r[4],
            gpu_memory_mib=r[5],
            user_id=r[6],
            group_id=r[7],
            job_id=r[8],
            lost_from=None if r[9] is None else float(r[9]),
        )


_RUNS_SQL = """
SELECT DISTINCT a.gpu_id, t.id, date_part('epoch', t.started_at),
       date_part('epoch', t.ended_at), j.gpu_memory_mib, g.memory_total_mib,
       j.owner_id, j.group_id, j.id, date_part('epoch', t.lost_since)
FROM scheduler_allocation a
JOIN scheduler_attempt t ON t.id = a.attempt_id
JOIN scheduler_job j ON j.id = t.job_id
JOIN scheduler_gpu g ON g.id = a.gpu_id
WHERE a.gpu_id = ANY(%s) AND t.started_at IS NOT NULL
  AND t.started_at <= %s AND (t.ended_at IS NULL OR t.ended_at >= %s)
"""


def load_runs(
    gpu_ids: Collection[int], since: datetime, until: datetime
) -> list[RunRow]:
    """Every started attempt's run on these GPUs overlapping [since, until]."""
    with connection.cursor() as cursor:
        cursor.execute(_RUNS_SQL, [list(gpu_ids), until, since])
        return [RunRow.from_row(r) for r in cursor.fetchall()]


def as_runs(rows: Iterable[RunRow], mode: str) -> list[charging.Run]:
    return [
        charging.Run(
            r.attempt_id,
            r.start,
            r.end,
            charging.weight(mode, r.declared_mib, r.gpu_memory_mib),
            r.lost_from,
        )
        for r in rows
    ]


def _gpus_of(attempt: Attempt) -> list[int]:
    return sorted(
        set(Allocation.objects.filter(attempt=attempt).values_list("gpu_id", flat=True))
    )


def charge(attempt: Attempt) -> None:
    """Charge an attempt that just ended (and re-charge its neighbours on its GPUs
    that ended while it ran). In the transaction that ended it."""
    if attempt.started_at is None or attempt.ended_at is None:
        return  # never ran: nothing to charge
    recharge(_gpus_of(attempt), attempt.started_at, attempt.ended_at)
    # An end reported late changes GPU hours computed as if it still ran.
    hours.note_change(attempt.ended_at)


def recharge_after_start(attempt: Attempt) -> None:
    """A start reported after a neighbour on the same GPU had ended past it (a late
    report): that neighbour was charged as if alone; charge it again."""
    if attempt.started_at is None:
        return
    hours.note_change(attempt.started_at)
    gpus = _gpus_of(attempt)
    stale = UsageRecord.objects.filter(
        gpu_id__in=gpus, ended_at__gt=attempt.started_at
    ).exclude(attempt=attempt)
    if stale.exists():
        recharge(gpus, attempt.started_at, max(timezone.now(), attempt.started_at))


def runs_changed(gpu_ids: list[int], since: datetime, until: datetime) -> None:
    """A late report moved a run's start or end within [since, until): charge again
    what overlaps it on ``gpu_ids`` (none when the run never started) and have the
    GPU hours recomputed from ``since``."""
    if gpu_ids and until > since:
        recharge(gpu_ids, since, until)
    hours.note_change(since)


class Handlers:
    """``scheduler.hooks.Accounting``: what the scheduler's services report."""

    def attempt_started(self, attempt: Attempt) -> None:
        recharge_after_start(attempt)

    def attempt_ended(self, attempt: Attempt) -> None:
        charge(attempt)

    def runs_changed(
        self, gpu_ids: list[int], since: datetime, until: datetime
    ) -> None:
        runs_changed(gpu_ids, since, until)

    def samples_changed(self, since: datetime, now: datetime) -> None:
        hours.note_change(since, now)


def recharge(gpu_ids: list[int], since: datetime, until: datetime) -> None:
    """Recompute the records of every ended attempt on ``gpu_ids`` whose run
    overlaps [since, until) (the run that changed).

    1. Lock the GPUs (id order): two attempts of one GPU ending at once are charged
       one after the other, the second seeing the first's end.
    2. Load the runs overlapping the window; widen it to the ended ones' whole runs
       and load again, so each one's neighbours are all known.
    3. Split each GPU's time by weight and UTC day into the charged part and
       the lost work of attempts stopped to be requeued (``Attempt.lost_since``,
       ``charging.split_parts``); write the records (upsert on (attempt, gpu))
       and their days (replaced).
    """
    if not gpu_ids:
        return
    list(
        Gpu.objects.select_for_update(no_key=True)
        .filter(pk__in=gpu_ids)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    rows = load_runs(gpu_ids, since, until)
    targets = {(r.attempt_id, r.gpu_id) for r in rows if r.end is not None}
    if not targets:
        return
    ended = [r for r in rows if r.end is not None]
    lo = min(r.start for r in ended)
    hi = max(r.end for r in ended if r.end is not None)
    if lo < since.timestamp() or hi > until.timestamp():
        rows = load_runs(gpu_ids, _dt(lo), _dt(hi))
    now = max(timezone.now().timestamp(), hi)
    mode = settings.GPULAB_SHARED_CHARGE
    by_gpu: dict[int, list[RunRow]] = defaultdict(list)
    for r in rows:
        by_gpu[r.gpu_id].append(r)
    splits = {
        g: charging.split_parts(as_runs(rs, mode), now) for g, rs in by_gpu.items()
    }
    chosen = [r for r in rows if (r.attempt_id, r.gpu_id) in targets]
    measured = _measurements(chosen)
    records = []
    for r in chosen:
        assert r.end is not None
        charged, lost = splits[r.gpu_id]
        seconds = sum(charged.get(r.attempt_id, {}).values())
        lost_seconds = sum(lost.get(r.attempt_id, {}).values())
        duration = r.end - r.start
        if duration > 0:
            share = min(1.0, (seconds + lost_seconds) / duration)
        else:  # no time to average over: its share at its start
            share = charging.share_at(
                as_runs(by_gpu[r.gpu_id], mode), r.attempt_id, r.start
            )
        gpu_energy, util = measured.get((r.attempt_id, r.gpu_id), (None, None))
        records.append(
            UsageRecord(
                attempt_id=r.attempt_id,
                gpu_id=r.gpu_id,
                user_id=r.user_id,
                group_id=r.group_id,
                started_at=_dt(r.start),
                ended_at=_dt(r.end),
                share=share,
                gpu_seconds=seconds,
                lost_gpu_seconds=lost_seconds,
                energy_j=None if gpu_energy is None else gpu_energy * share,
                util_gpu_mean=util,
            )
        )
    UsageRecord.objects.bulk_create(
        records,
        update_conflicts=True,
        unique_fields=["attempt", "gpu"],
        update_fields=[
            "user",
            "group",
            "started_at",
            "ended_at",
            "share",
            "gpu_seconds",
            "lost_gpu_seconds",
            "energy_j",
            "util_gpu_mean",
        ],
    )
    ids = {
        (a, g): pk
        for pk, a, g in UsageRecord.objects.filter(
            attempt_id__in={a for a, _ in targets}, gpu_id__in=gpu_ids
        ).values_list("pk", "attempt_id", "gpu_id")
    }
    DailyUsage.objects.filter(record_id__in=ids.values()).delete()
    daily = []
    for r, record in zip(chosen, records, strict=True):
        charged, lost = splits[r.gpu_id]
        by_day = charged.get(r.attempt_id, {})
        lost_by_day = lost.get(r.attempt_id, {})
        held = record.gpu_seconds + record.lost_gpu_seconds
        for day in sorted({*by_day, *lost_by_day}):
            seconds = by_day.get(day, 0.0)
            lost_seconds = lost_by_day.get(day, 0.0)
            part = (seconds + lost_seconds) / held if held else 0.0
            daily.append(
                DailyUsage(
                    record_id=ids[r.attempt_id, r.gpu_id],
                    day=day,
                    user_id=r.user_id,
                    group_id=r.group_id,
                    job_id=r.job_id,
                    gpu_seconds=seconds,
                    lost_gpu_seconds=lost_seconds,
                    energy_j=None
                    if record.energy_j is None
                    else record.energy_j * part,
                    busy_gpu_seconds=None
                    if record.util_gpu_mean is None
                    else seconds * record.util_gpu_mean / 100.0,
                )
            )
    DailyUsage.objects.bulk_create(daily)


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


_SAMPLES_SQL = """
SELECT w.attempt_id, w.gpu_id,
       count(s.energy_mj),
       date_part('epoch', min(s.at) FILTER (WHERE s.energy_mj IS NOT NULL)),
       date_part('epoch', max(s.at) FILTER (WHERE s.energy_mj IS NOT NULL)),
       (array_agg(s.energy_mj ORDER BY s.at) FILTER (WHERE s.energy_mj IS NOT NULL))[1],
       (array_agg(s.energy_mj ORDER BY s.at DESC)
            FILTER (WHERE s.energy_mj IS NOT NULL))[1],
       avg(s.util_gpu)
FROM unnest(%s::bigint[], %s::bigint[], %s::timestamptz[], %s::timestamptz[])
     AS w(attempt_id, gpu_id, since, until)
JOIN scheduler_gpusample s
  ON s.gpu_id = w.gpu_id AND s.at >= w.since AND s.at <= w.until AND NOT s.lost
GROUP BY w.attempt_id, w.gpu_id
"""


def _measurements(
    rows: list[RunRow],
) -> dict[tuple[int, int], tuple[float | None, float | None]]:
    """For each (attempt, GPU) run, from the GPU's persisted samples over it: the
    GPU's energy in joules (the NVML counter's rise between the first and last
    sample, scaled to the whole run: samples are some seconds apart; None with
    fewer than two readings or a counter that went backwards, e.g. a driver
    reload) and its mean utilisation (%, None without samples). One query."""
    if not rows:
        return {}
    ends = [r.end if r.end is not None else r.start for r in rows]
    with connection.cursor() as cursor:
        cursor.execute(
            _SAMPLES_SQL,
            [
                [r.attempt_id for r in rows],
                [r.gpu_id for r in rows],
                [_dt(r.start) for r in rows],
                [_dt(e) for e in ends],
            ],
        )
        found = cursor.fetchall()
    duration = {
        (r.attempt_id, r.gpu_id): e - r.start for r, e in zip(rows, ends, strict=True)
    }
    out: dict[tuple[int, int], tuple[float | None, float | None]] = {}
    for attempt_id, gpu_id, n, first_at, last_at, first, last, util in found:
        energy = None
        if n >= 2 and last_at > first_at and last >= first:
            span = float(last_at) - float(first_at)
            energy = (last - first) / 1000.0 * duration[attempt_id, gpu_id] / span
        out[attempt_id, gpu_id] = (energy, None if util is None else float(util))
    return out
