"""Idle flags: one per period a running attempt was found idle."""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.db.models import Q

from scheduler.models import Attempt, Job


class IdleFlag(models.Model):
    """A running job found idle (``portal.idle.detect``), from ``since`` (the start
    of the samples that show it idle) with the figures seen. Open while
    ``cleared_at`` is null; cleared when the job is active again or its attempt
    ends. Written only by ``portal.idle.detect.check``.
    """

    class Cleared(models.TextChoices):
        ACTIVE = "active", "active again"
        ENDED = "ended", "attempt ended"
        CANCELLED = "cancelled", "cancelled for idleness"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="idle_flags")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="+")
    since = models.DateTimeField()
    flagged_at = models.DateTimeField()
    checked_at = models.DateTimeField()
    # The rule that flagged it, and what the samples showed (own processes only).
    threshold = models.FloatField()
    window_s = models.PositiveIntegerField()
    util_max = models.FloatField()
    util_mean = models.FloatField()
    memory_mib = models.BigIntegerField(null=True, blank=True)
    gpus = models.PositiveSmallIntegerField()
    action = models.CharField(max_length=16)
    cancel_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    cleared_at = models.DateTimeField(null=True, blank=True)
    cleared = models.CharField(max_length=16, choices=Cleared.choices, blank=True)

    class Meta:
        ordering = ("-flagged_at", "-id")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["attempt"],
                condition=Q(cleared_at__isnull=True),
                name="idle_one_open_flag_per_attempt",
            )
        ]
        indexes: ClassVar = [
            models.Index(
                fields=["job"],
                condition=Q(cleared_at__isnull=True),
                name="idle_open_flag_job",
            )
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} idle since {self.since:%Y-%m-%d %H:%M}"


class Activity(models.Model):
    """When a person last used a running job through the portal: a request or a
    websocket message to its JupyterLab, a keystroke in one of its terminals.

    The idle check counts it as activity beside the GPU's own (an interactive job
    whose notebook is being read is not idle even when its GPU is). One row per
    job, moved forward only (``portal.idle.activity.touch``); deleted with the job.
    """

    job = models.OneToOneField(
        Job, on_delete=models.CASCADE, primary_key=True, related_name="activity"
    )
    at = models.DateTimeField()

    def __str__(self) -> str:
        return f"job {self.job_id} used at {self.at:%Y-%m-%d %H:%M:%S}"
