"""A person's use through the portal (``portal.idle.activity``) counts as activity
for the idle check: an interactive job whose GPU is idle but whose notebook or
terminal is in use is not flagged, and use during the grace clears the flag."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.db import connections

from portal.idle import activity, detect
from portal.idle.models import Activity
from scheduler.models import Job, JobEvent
from tests.idle import test_detect
from tests.idle.test_detect import (
    NOW,
    STEP,
    cancel_class,
    gpu_of,
    open_flag,
    proc,
    run,
    series,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node


node = test_detect.node  # the same fixture: a node with two GPUs


def test_use_within_the_window_keeps_a_job_with_an_idle_gpu_unflagged(
    alice: User, node: Node
) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    series(
        gpu_of(attempt), NOW - timedelta(minutes=40), NOW, lambda at: [proc(attempt, 0)]
    )
    assert activity.touch(attempt.job_id, at=NOW - timedelta(minutes=29))

    assert detect.check(NOW).flagged == []
    # Once the use is older than the window, the idle GPU counts again, and the
    # idle run starts at the last use, not before it.
    later = NOW + timedelta(minutes=2)
    series(gpu_of(attempt), NOW + STEP, later, lambda at: [proc(attempt, 0)])
    assert detect.check(later).flagged == [attempt.job_id]
    flag = open_flag(attempt)
    assert flag is not None and flag.since == NOW - timedelta(minutes=29)
    event = JobEvent.objects.get(job_id=attempt.job_id, message__startswith="flagged")
    assert "last used through the portal at" in event.message


def test_use_during_the_grace_clears_the_flag_and_the_job_is_not_cancelled(
    alice: User, node: Node, settings: Any
) -> None:
    cancel_class(settings, grace=600)
    attempt = run(alice, node, started=NOW - timedelta(hours=1), klass="best-effort")
    gpu = gpu_of(attempt)
    series(gpu, NOW - timedelta(minutes=31), NOW + timedelta(minutes=11),
           lambda at: [proc(attempt, 0)])  # fmt: skip
    with time_machine.travel(NOW, tick=False):
        assert detect.check().flagged == [attempt.job_id]
    assert activity.touch(attempt.job_id, at=NOW + timedelta(minutes=5))

    with time_machine.travel(NOW + timedelta(minutes=10), tick=False):
        result = detect.check()

    assert result.cancelled == [] and result.cleared == [attempt.job_id]
    assert Job.objects.get(pk=attempt.job_id).cancel_requested_at is None


def test_a_job_idle_since_its_last_use_is_cancelled_after_the_grace(
    alice: User, node: Node, settings: Any
) -> None:
    """The idle run begins at the last use through the portal (the GPU idle
    all along): that use is not activity after the flag, which stays."""
    cancel_class(settings, grace=600)
    attempt = run(alice, node, started=NOW - timedelta(hours=1), klass="best-effort")
    series(gpu_of(attempt), NOW - timedelta(minutes=50), NOW + timedelta(minutes=11),
           lambda at: [proc(attempt, 0)])  # fmt: skip
    assert activity.touch(attempt.job_id, at=NOW - timedelta(minutes=31))
    with time_machine.travel(NOW, tick=False):
        assert detect.check().flagged == [attempt.job_id]
    flag = open_flag(attempt)
    assert flag is not None and flag.since == NOW - timedelta(minutes=31)

    with time_machine.travel(NOW + timedelta(minutes=1), tick=False):
        assert detect.check().cleared == []
    with time_machine.travel(NOW + timedelta(minutes=10, seconds=30), tick=False):
        result = detect.check()

    assert result.cleared == [] and result.cancelled == [attempt.job_id]
    assert Job.objects.get(pk=attempt.job_id).cancel_requested_at is not None


def test_a_process_writes_a_jobs_use_once_per_resolution_and_never_backwards(
    alice: User, node: Node, settings: Any
) -> None:
    settings.GPULAB_INTERACTIVE_ACTIVITY_RESOLUTION = 30
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    job_id = attempt.job_id
    assert activity.touch(job_id, at=NOW)
    assert not activity.touch(job_id, at=NOW + timedelta(seconds=5))
    assert Activity.objects.get(job_id=job_id).at == NOW

    # Another process (its own memory) writing an older time moves nothing back.
    activity._written.clear()
    assert activity.touch(job_id, at=NOW - timedelta(minutes=1))
    assert Activity.objects.get(job_id=job_id).at == NOW
    assert activity.last_used([job_id, job_id + 1]) == {job_id: NOW}


def test_a_deleted_job_records_nothing(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))
    Job.objects.filter(pk=attempt.job_id).delete()

    assert activity.touch(attempt.job_id, at=NOW)
    assert not Activity.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_atouch_writes_from_the_event_loop(alice: User, node: Node) -> None:
    attempt = run(alice, node, started=NOW - timedelta(hours=1))

    async def twice() -> tuple[bool, bool]:
        return await activity.atouch(attempt.job_id), await activity.atouch(
            attempt.job_id
        )

    assert async_to_sync(twice)() == (True, False)
    assert Activity.objects.filter(job_id=attempt.job_id).count() == 1
    # The write ran in a thread of its own: its connection closes with the test.
    async_to_sync(database_sync_to_async(connections.close_all))()
