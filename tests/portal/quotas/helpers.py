"""Arrange usage the way production makes it: jobs started and ended through the
services, with the agent-reported times (the authoritative ones)."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, Any

import time_machine

from portal.quotas.models import Quota
from scheduler import services
from scheduler.models import Attempt, Job
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from datetime import datetime

    from django.contrib.auth.models import User

    from scheduler.models import Node


def run(
    owner: User,
    node: Node,
    start: datetime,
    end: datetime | None = None,
    *,
    gpus: int = 1,
    **job: Any,
) -> Attempt:
    """A job of ``owner`` started at ``start`` on ``gpus`` GPUs of ``node`` and,
    with ``end``, ended then (its usage recorded); else left running."""
    j = JobFactory(owner=owner, gpus=gpus, **job)
    with time_machine.travel(start, tick=False):
        attempt = start_job(j, node)
        assert services.mark_started(node.pk, started_data(attempt, start.timestamp()))
    if end is not None:
        with time_machine.travel(end, tick=False):
            assert services.finish_attempt(
                node.pk, exited_data(attempt, 0, at=end.timestamp())
            )
        assert Job.objects.get(pk=j.pk).status == Job.Status.COMPLETED
    return attempt


def quota(**fields: Any) -> Quota:
    if "gpu_hours" in fields and fields["gpu_hours"] is not None:
        fields["gpu_hours"] = Decimal(str(fields["gpu_hours"]))
    q = Quota(**fields)
    q.full_clean()
    q.save()
    return q
