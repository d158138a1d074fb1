"""Persisted GPU readings: raw samples and their minute / hour rollups."""

from __future__ import annotations

from typing import ClassVar

from django.db import models

from scheduler.models.nodes import Gpu


class GpuSample(models.Model):
    """One persisted reading of one GPU (every ``GPULAB_METRICS_PERSIST_INTERVAL``
    seconds; the 1 Hz stream stays live-only).

    The table is partitioned by day on ``at`` (created by a migration, kept by
    ``scheduler.metrics``): retention drops whole partitions instead of deleting rows.
    The primary key (gpu, at) is what de-duplicates samples an agent replays.
    ``processes`` holds ``[{pid, used_memory_mib, sm_util, attempt_id}]``; a process
    with no attempt is foreign (nobody scheduled it).
    """

    pk = models.CompositePrimaryKey("gpu_id", "at")
    gpu = models.ForeignKey(
        Gpu, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    at = models.DateTimeField()
    util_gpu = models.FloatField(null=True)
    util_mem = models.FloatField(null=True)
    memory_used_mib = models.IntegerField(null=True)
    temperature_c = models.FloatField(null=True)
    power_w = models.FloatField(null=True)
    sm_clock_mhz = models.IntegerField(null=True)
    pcie_rx_kib_s = models.BigIntegerField(null=True)
    pcie_tx_kib_s = models.BigIntegerField(null=True)
    ecc_uncorrected = models.BigIntegerField(null=True)
    energy_mj = models.BigIntegerField(null=True)
    lost = models.BooleanField(default=False)
    processes = models.JSONField(default=list)

    class Meta:
        managed = False  # a partitioned table: see migration 0002
        db_table = "scheduler_gpusample"

    def __str__(self) -> str:
        return f"GPU {self.gpu_id} at {self.at:%Y-%m-%d %H:%M:%S}"


class GpuRollup(models.Model):
    """Min / mean / max of a GPU's samples over one minute or one hour, kept longer
    than raw samples (``GPULAB_ROLLUP_1M_DAYS``, ``GPULAB_ROLLUP_1H_DAYS``)."""

    class Resolution(models.TextChoices):
        MINUTE = "1m", "1 minute"
        HOUR = "1h", "1 hour"

    gpu = models.ForeignKey(
        Gpu, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    resolution = models.CharField(max_length=2, choices=Resolution.choices)
    start = models.DateTimeField()
    samples = models.PositiveIntegerField()
    util_gpu_min = models.FloatField(null=True)
    util_gpu_mean = models.FloatField(null=True)
    util_gpu_max = models.FloatField(null=True)
    util_mem_mean = models.FloatField(null=True)
    memory_used_mean = models.FloatField(null=True)
    memory_used_max = models.IntegerField(null=True)
    power_mean = models.FloatField(null=True)
    power_max = models.FloatField(null=True)
    temperature_mean = models.FloatField(null=True)
    temperature_max = models.FloatField(null=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["gpu", "resolution", "start"],
                name="%(app_label)s_%(class)s_unique",
            )
        ]
        indexes: ClassVar = [models.Index(fields=["resolution", "start"])]

    def __str__(self) -> str:
        return f"GPU {self.gpu_id} {self.resolution} at {self.start:%Y-%m-%d %H:%M}"
