"""The charging ledger: GPU-seconds charged per attempt and GPU."""

from __future__ import annotations

from typing import ClassVar

from django.conf import settings
from django.db import models
from django.db.models import Q

from scheduler.models.accounts import Group
from scheduler.models.attempts import Attempt
from scheduler.models.nodes import Gpu


class UsageRecord(models.Model):
    """GPU-seconds charged to one attempt on one GPU, from agent-reported start to
    end (written and, when a neighbour's times change it, rewritten by
    ``portal.accounting.services``).

    ``share`` is the time-average fraction of the GPU held by the attempt (on a
    shared GPU by declared memory or equally, ``GPULAB_SHARED_CHARGE``), so a
    GPU-second is never charged twice. ``lost_gpu_seconds``: the part of its GPU
    time after ``Attempt.lost_since`` (an attempt stopped to be requeued: the
    work since its last checkpoint, or its whole run), charged to nobody: it is
    not in ``gpu_seconds``, which quotas and fair share read; the usage reports
    show it as its own line. ``energy_j``: the GPU's energy counter over
    the attempt times ``share`` (null where the GPU reports none);
    ``util_gpu_mean``: the GPU's mean utilisation (%) over the attempt, from the
    persisted samples. Input of fair share, quotas and the usage reports.
    """

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="usage")
    gpu = models.ForeignKey(Gpu, on_delete=models.PROTECT, related_name="+")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    group = models.ForeignKey(Group, on_delete=models.PROTECT, related_name="+")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    share = models.FloatField()
    gpu_seconds = models.FloatField()
    lost_gpu_seconds = models.FloatField(default=0.0, db_default=0.0)
    energy_j = models.FloatField(null=True, blank=True)
    util_gpu_mean = models.FloatField(null=True, blank=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["attempt", "gpu"], name="%(app_label)s_%(class)s_unique"
            ),
            models.CheckConstraint(
                condition=Q(gpu_seconds__gte=0),
                name="%(app_label)s_%(class)s_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(lost_gpu_seconds__gte=0),
                name="%(app_label)s_%(class)s_lost_non_negative",
            ),
        ]
        indexes: ClassVar = [
            models.Index(fields=["group", "ended_at"]),
            models.Index(fields=["user", "ended_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.attempt} on GPU {self.gpu_id}: {self.gpu_seconds:.0f} GPU-s"
