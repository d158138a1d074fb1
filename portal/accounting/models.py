"""Daily rollup of the usage records: what the Usage page reads at scale."""

from __future__ import annotations

from typing import ClassVar

from django.conf import settings
from django.db import models

from scheduler.models import Gpu, Group, UsageRecord


class DailyUsage(models.Model):
    """The part of one usage record (an attempt on a GPU) that fell in one UTC day:
    its GPU-seconds charged that day (exact, from the charging sweep), its lost
    work that day (``UsageRecord.lost_gpu_seconds``: charged to nobody), the
    day's part of its energy in proportion to its GPU time that day (charged and
    lost), and its busy GPU-seconds (charged GPU-seconds x mean utilisation).

    Written only with its record, in the same transaction, by
    ``portal.accounting.services.charge`` (deleted and rewritten when the record
    is); a running attempt has none until it ends (reports add it live).
    """

    record = models.ForeignKey(UsageRecord, on_delete=models.CASCADE, related_name="+")
    day = models.DateField()
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    group = models.ForeignKey(Group, on_delete=models.PROTECT, related_name="+")
    job_id = models.BigIntegerField()
    gpu_seconds = models.FloatField()
    lost_gpu_seconds = models.FloatField(default=0.0, db_default=0.0)
    energy_j = models.FloatField(null=True, blank=True)
    busy_gpu_seconds = models.FloatField(null=True, blank=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["record", "day"], name="%(app_label)s_%(class)s_unique"
            ),
            models.CheckConstraint(
                condition=models.Q(gpu_seconds__gte=0),
                name="%(app_label)s_%(class)s_non_negative",
            ),
        ]
        indexes: ClassVar = [
            models.Index(fields=["group", "day"], name="accounting_daily_group_idx"),
            models.Index(fields=["user", "day"], name="accounting_daily_user_idx"),
        ]

    def __str__(self) -> str:
        return f"record {self.record_id} on {self.day}: {self.gpu_seconds:.0f} GPU-s"


class GpuHour(models.Model):
    """One GPU's use in one UTC hour: what the admin overview sums per day.

    ``held_seconds``: the time the GPU ran at least one started attempt (the
    GPU-seconds charged to jobs, ``charging.pieces``: a shared GPU's second counts
    once). ``idle_seconds``: the part of them charged to attempts that were idle
    by ``portal.idle.evidence`` (each attempt its share); null when the hour was
    first computed after its raw samples were dropped (no evidence kept).

    Written only by ``portal.accounting.hours.maintain`` (beat's
    ``maintain_hours``), which recomputes whole hours from the runs and the
    samples and replaces them: a rerun never adds twice.
    """

    gpu = models.ForeignKey(
        Gpu, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    start = models.DateTimeField()
    held_seconds = models.FloatField()
    idle_seconds = models.FloatField(null=True, blank=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["gpu", "start"], name="%(app_label)s_%(class)s_unique"
            ),
            models.CheckConstraint(
                condition=models.Q(held_seconds__gte=0),
                name="%(app_label)s_%(class)s_non_negative",
            ),
        ]
        indexes: ClassVar = [
            models.Index(fields=["start"], name="accounting_gpuhour_start_idx")
        ]

    def __str__(self) -> str:
        return (
            f"GPU {self.gpu_id} {self.start:%Y-%m-%d %H:00}: {self.held_seconds:.0f} s"
        )


class GpuHourStale(models.Model):
    """``GpuHour`` rows from ``since`` on may be wrong: the next
    ``hours.maintain`` recomputes from the earliest such mark and deletes the
    marks it read. Marks come from the rollup itself (where it stopped: the next
    run goes on from there, so a worker that was down leaves no hole), from a
    report that changed the past (an exit or a start reported late, a lost
    node's real exit) and from samples replayed late after a disconnect. The
    migration that made the table left one mark 31 days back: the backfill."""

    since = models.DateTimeField()

    def __str__(self) -> str:
        return f"GPU hours stale since {self.since:%Y-%m-%d %H:%M}"
