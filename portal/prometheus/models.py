"""The GPU-seconds charged per group, kept as usage records are written, so a scrape
reads one row per group instead of summing the whole ledger.

PostgreSQL keeps them (triggers on ``scheduler_usagerecord``, migration 0001): each
insert, update or delete of a record appends its change to ``GpuSecondsDelta``
in the writer's own transaction (an append: writers never wait on each other);
``portal.prometheus.ledger`` folds the deltas into ``GpuSecondsTotal`` at a scrape.
A group's GPU-seconds = its total + its pending deltas, exactly the sum of its
records in every committed state. No foreign keys: a row of a group that is gone
(it had no records then) is never read.
"""

from __future__ import annotations

from django.db import models


class GpuSecondsTotal(models.Model):
    """The folded GPU-seconds of one group's usage records."""

    group_id = models.BigIntegerField(primary_key=True)
    seconds = models.DecimalField(max_digits=40, decimal_places=10, default=0)

    def __str__(self) -> str:
        return f"group {self.group_id}: {self.seconds} GPU-s"


class GpuSecondsDelta(models.Model):
    """One change of one group's usage records, not folded into its total yet."""

    id = models.BigAutoField(primary_key=True)
    group_id = models.BigIntegerField()
    seconds = models.DecimalField(max_digits=40, decimal_places=10)

    def __str__(self) -> str:
        return f"group {self.group_id}: {self.seconds:+} GPU-s"
