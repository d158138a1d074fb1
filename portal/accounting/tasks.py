"""Beat's GPU-hour maintenance."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from portal.accounting import hours


@shared_task(ignore_result=True)
def maintain_hours() -> dict[str, Any]:
    """Bring the GPU hours (held / idle, the admin overview's) up to date and drop
    those past retention (beat, every minute)."""
    return hours.maintain()
