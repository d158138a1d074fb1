"""What co-location learned about pairs of workloads sharing a GPU."""

from __future__ import annotations

import math
from typing import ClassVar

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class InterferencePair(models.Model):
    """What was learned about one ordered pair of workloads sharing a GPU: A's
    slowdown beside B (``workload_a``'s), as log slowdowns observed per sharing
    episode (count, mean, M2: ``policy.interference.Observations``), and whether
    the pass evicted a job of this pair (``harmful``: never admitted again until
    an admin resets it). Read by the snapshot into ``policy.Knowledge``."""

    workload_a = models.CharField(max_length=128)
    workload_b = models.CharField(max_length=128)
    n = models.PositiveIntegerField(default=0)
    mean_log = models.FloatField(default=0.0)
    m2 = models.FloatField(default=0.0)
    # The weak evidence: slowdowns read from per-process NVML utilisation (solo
    # busy fraction over busy fraction while shared) for episodes where a job
    # reported no progress; the model counts each at a fraction of an observation.
    util_n = models.PositiveIntegerField(default=0)
    util_mean_log = models.FloatField(default=0.0)
    util_m2 = models.FloatField(default=0.0)
    harmful = models.BooleanField(default=False)
    harmful_reason = models.CharField(max_length=500, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    reset_at = models.DateTimeField(null=True, blank=True)
    reset_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        ordering = ("workload_a", "workload_b")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["workload_a", "workload_b"],
                name="%(app_label)s_%(class)s_unique_pair",
            ),
            models.CheckConstraint(
                condition=Q(m2__gte=0) & Q(util_m2__gte=0),
                name="%(app_label)s_%(class)s_m2_non_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workload_a or '(unlabelled)'} beside {self.workload_b or '(unlabelled)'}"

    @property
    def slowdown(self) -> float | None:
        """The mean observed slowdown (geometric), None before any observation."""
        return math.exp(self.mean_log) if self.n else None
