"""Celery beat's entry that folds the GPU-seconds deltas (``portal.prometheus.ledger``)
when no scrape does, so they never pile up."""

from __future__ import annotations

from celery import shared_task


@shared_task(ignore_result=True)
def fold(**kwargs: object) -> int:
    """Every ``GPULAB_METRICS_FOLD_INTERVAL`` seconds."""
    from portal.prometheus import ledger

    return ledger.fold()
