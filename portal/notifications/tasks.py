"""Celery tasks of the notifications queue (a worker of its own consumes it)."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from portal.notifications import services


@shared_task(ignore_result=True)
def deliver(delivery_id: int) -> dict[str, Any] | None:
    """Send one delivery; after a failure, come back when its backoff is over."""
    result = services.send(delivery_id)
    if result is None:
        return None
    if result.retry_in is not None:
        services.enqueue(delivery_id, countdown=result.retry_in)
    return {"id": result.delivery_id, "status": result.status}


@shared_task(ignore_result=True)
def sweep() -> int:
    """Beat's backstop, on the notifications queue: send deliveries that are due
    but were in no queue (the broker was down at commit, a worker died mid-send, a
    countdown was lost). A row another task is sending is skipped (``send``'s
    claim)."""
    sent = 0
    for delivery_id in services.due():
        if services.send(delivery_id) is not None:
            sent += 1
    return sent


def route(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, str] | None:
    """Celery router: this module's tasks go to the notifications queue (read at
    send time, so the Redis prefix of the running deployment is used)."""
    from django.conf import settings

    if name.startswith("portal.notifications.tasks."):
        return {"queue": f"{settings.REDIS_PREFIX}.notifications"}
    return None
