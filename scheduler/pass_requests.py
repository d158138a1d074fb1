"""Asking for a scheduling pass: the flags the services and the pass runner share.

Below ``scheduler.services`` (which ask for passes after their changes commit) and
the pass runner (``scheduler.pass_runner``, which clears the flags), so neither
imports the other or ``scheduler.tasks``:

- the "pass queued" mark (``claim_pass_request``): a pass task is queued and has
  not begun loading the state, so a further request need not enqueue another;
- the "rerun requested" flag: a pass was asked for while one ran, which loops once
  more;
- ``schedule_pass``: the pass task, enqueued by its registered name.
"""

from __future__ import annotations

import redis
from celery import current_app
from django.conf import settings

# How long a pass request marks a pass as queued (claim_pass_request): if its task
# is lost (a worker killed before it began), requests enqueue again after this.
QUEUED_TTL_S = 10

_redis: redis.Redis | None = None


class TaskByName:
    """A Celery task enqueued by its registered name: ``delay`` looks the task up
    in the app's registry when called, so a module below ``scheduler.tasks``
    enqueues a task defined there without importing it (``SchedulerConfig.ready``
    imports ``scheduler.tasks``: every Django process has its tasks registered)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def delay(self) -> None:
        current_app.tasks[self.name].delay()


schedule_pass = TaskByName("scheduler.tasks.schedule_pass")


def _redis_client() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL)
    return _redis


def _rerun_key() -> str:
    return f"{settings.REDIS_PREFIX}:schedule:rerun"


def _queued_key() -> str:
    return f"{settings.REDIS_PREFIX}:schedule:queued"


def claim_pass_request() -> bool:
    """True if the caller should enqueue a pass: none is queued and not yet begun.

    A pass per submission of a burst would be thousands of tasks that each take
    the advisory lock's query, find a pass running and set the rerun flag: about
    half of the worker's time (bench/submit_burst.py). A queued pass that
    has not begun will load every change committed before it begins, so one is
    enough: the first request marks it queued (SET NX) and enqueues it, the rest
    return. The mark is cleared just before a pass loads the state
    (``pass_runner.schedule_pass_body``); a request after that enqueues a new pass.
    """
    return bool(_redis_client().set(_queued_key(), "1", nx=True, ex=QUEUED_TTL_S))
