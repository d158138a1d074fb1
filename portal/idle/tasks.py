"""Beat's idle check."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from portal.idle import detect


@shared_task(ignore_result=True)
def check_idle() -> dict[str, Any]:
    """Flag idle running jobs, clear the ones active again, cancel per class."""
    result = detect.check()
    return {
        "flagged": result.flagged,
        "cleared": result.cleared,
        "cancelled": result.cancelled,
        "ended": result.ended,
    }
