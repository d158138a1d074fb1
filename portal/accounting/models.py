"""Daily rollup of the usage records: what the Usage page reads at scale."""

from __future__ import annotations

from typing import ClassVar

from django.conf import settings
from django.db import models

from scheduler.models import Group, UsageRecord


class DailyUsage(models.Model):
    """The part of one usage record (an attempt on a GPU) that fell in one UTC day:
    its GPU-seconds charged that day (exact, from the charging sweep), and the
    day's part of its energy and of its busy GPU-seconds (GPU-seconds x mean
    utilisation), both in proportion to its GPU-seconds that day.

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
