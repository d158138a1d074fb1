"""Celery tasks: thin adapters around ``scheduler.services`` and the pass runner
(``scheduler.pass_runner``)."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from scheduler import metrics, services
from scheduler.pass_runner import schedule_pass_body

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def schedule_pass() -> dict[str, Any]:
    """Run the scheduler (triggered on submit, job exit, node change and by beat);
    each pass logs its own statistics (``scheduler.pass_log``)."""
    return schedule_pass_body()


@shared_task(ignore_result=True)
def check_nodes() -> dict[str, list[int]]:
    """Mark nodes without heartbeat as lost and requeue their jobs; stop jobs past
    their time limit that their agent did not stop; re-send launches that never
    arrived and kills no exit answered (beat)."""
    return {
        "lost_nodes": services.mark_lost_nodes(),
        "overdue_jobs": services.enforce_time_limits(),
        "launches_resent": services.resend_launches(),
        "kills_resent": services.resend_kills(),
    }


@shared_task(ignore_result=True)
def reconcile() -> dict[str, list[int]]:
    """Compare what the agents hold with the database and repair the drift
    (``services.reconcile``; beat, every ``GPULAB_RECONCILE_INTERVAL`` s)."""
    result = services.reconcile()
    if result["stale"] or result["lost"]:
        log.warning("reconcile: %s", result)
    return result


@shared_task(ignore_result=True)
def maintain_metrics() -> dict[str, Any]:
    """Roll samples up, keep partitions ahead, drop what is past retention (beat;
    the GPU hours are ``portal.accounting.tasks.maintain_hours``)."""
    return metrics.maintain()
