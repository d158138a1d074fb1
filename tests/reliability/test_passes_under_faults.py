"""Scheduling passes on real Celery processes: a worker SIGKILLed in the middle of
a pass leaves none of its decisions applied and the next pass does the work; two
workers fed by two beats never give one GPU to two jobs."""

from __future__ import annotations

import itertools
import signal
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from django.db import connection

from tests.e2e.conftest import wait_for_job, wait_until
from tests.factories import JobFactory
from tests.reliability.processes import set_fast_liveness, start_beat, start_worker

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def locker(stack: Stack) -> Iterator[psycopg.Connection[Any]]:
    """Another session on the test database, holding row locks for the test."""
    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    conn = psycopg.connect(**params)
    yield conn
    conn.close()


def blocked_by(session: psycopg.Connection[Any]) -> tuple[int, str] | None:
    """(pid, query) of a session waiting for a lock ``session`` holds."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, query FROM pg_stat_activity"
            " WHERE %s = ANY(pg_blocking_pids(pid))",
            [session.info.backend_pid],
        )
        row = cursor.fetchone()
    return (int(row[0]), str(row[1])) if row else None


def tables_written_by(pid: int) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT relation::regclass::text FROM pg_locks"
            " WHERE pid = %s AND mode = 'RowExclusiveLock' AND relation IS NOT NULL",
            [pid],
        )
        return {row[0] for row in cursor.fetchall()}


def backend_alive(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid])
        return cursor.fetchone() is not None


def test_a_worker_killed_mid_pass_applies_nothing_and_the_next_pass_does_it(
    stack: Stack, alice: User, locker: psycopg.Connection[Any], marker: Path
) -> None:
    from scheduler import services
    from scheduler.models import Allocation, Attempt, Job, JobEvent
    from scheduler.services.jobs import JobRequest
    from scheduler.tasks import schedule_pass

    worker = stack.procs["worker"]
    stack.start_node("node-x", "1xA100-80GB", 1)
    victim = services.submit_job(
        alice,
        JobRequest(
            name="victim",
            command=f"while [ ! -e {marker} ]; do sleep 0.1; done",
            workdir="/tmp",
            priority_class="best-effort",
        ),
    )
    assert wait_for_job(victim.pk, {"running"}) == "running"
    seen = len(worker.lines)
    stack.start_node("node-y", "1xA100-80GB", 1)
    # The pass node-y's hello asked for is over: no other pass is on its way.
    worker.wait_for(r"schedule_pass\[.*\] succeeded", start=seen)
    # The next pass starts `high` on node-y (its attempt and allocations
    # inserted, the job moved to STARTING), then preempts the best-effort victim
    # on node-x for `normal`: holding the victim's row stops it there, its first
    # decision written but not committed.
    locker.execute("SELECT id FROM scheduler_job WHERE id = %s FOR UPDATE", [victim.pk])
    high = JobFactory(
        owner=alice, command="echo ran", workdir="/tmp", priority_class="high"
    )
    normal = JobFactory(owner=alice, command="echo ran", workdir="/tmp")

    schedule_pass.delay()
    pid, query = wait_until(lambda: blocked_by(locker), what="the pass blocked")

    assert query.startswith('SELECT "scheduler_job"'), query  # locking the victim
    assert {"scheduler_attempt", "scheduler_allocation"} <= tables_written_by(pid)
    worker.popen.send_signal(signal.SIGKILL)
    worker.popen.wait(10)
    locker.rollback()  # the dead worker's session finishes its statement, then dies
    wait_until(lambda: not backend_alive(pid), what="the killed pass's session gone")

    # Nothing of that pass was applied: no start, no preemption.
    assert Job.objects.get(pk=high.pk).status == Job.Status.PENDING
    assert not Attempt.objects.filter(job__in=[high, normal]).exists()
    assert set(
        Allocation.objects.filter(released_at__isnull=True).values_list(
            "attempt__job_id", flat=True
        )
    ) == {victim.pk}
    assert Attempt.objects.get(job=victim).kill_reason == ""

    start_worker(stack, "worker-2")
    schedule_pass.delay()

    assert wait_for_job(high.pk, set(Job.TERMINAL)) == "completed"
    assert wait_for_job(normal.pk, set(Job.TERMINAL)) == "completed"
    for job in (high, normal):
        assert Attempt.objects.filter(job=job).count() == 1
        assert JobEvent.objects.filter(job=job, to_status="starting").count() == 1
    # The victim's exit (it was told to stop) is recorded when its agent reports
    # it; `normal` may meanwhile have run on node-y, freed by `high`.
    wait_until(
        lambda: Job.objects.get(pk=victim.pk).preemptions > 0,
        what="the victim's preempted exit recorded",
    )
    victim.refresh_from_db()
    assert victim.preemptions == 1
    preempted = JobEvent.objects.filter(job=victim, message__startswith="preempted for")
    assert preempted.count() == 1


@pytest.fixture
def busy_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    set_fast_liveness(monkeypatch, GPULAB_SCHEDULE_INTERVAL="0.5")


def test_two_workers_and_two_beats_never_give_a_gpu_to_two_jobs(
    busy_beats: None, stack: Stack, alice: User
) -> None:
    from scheduler import services
    from scheduler.models import Allocation, Attempt, Job, JobEvent
    from scheduler.services.jobs import JobRequest

    start_worker(stack, "worker-2")
    start_beat(stack, "beat-1")
    start_beat(stack, "beat-2")
    stack.start_node("pair-a", "2xA100-80GB", 2)
    stack.start_node("pair-b", "2xA100-80GB", 2)

    ids = [
        services.submit_job(
            alice,
            JobRequest(name=f"burst-{i}", command="sleep 0.3", workdir="/tmp", gpus=1),
        ).pk
        for i in range(12)
    ]
    for job_id in ids:
        assert wait_for_job(job_id, set(Job.TERMINAL), timeout=120) == "completed"

    # Both workers ran passes (each took schedule_pass tasks from both beats).
    for name in ("worker", "worker-2"):
        stack.procs[name].wait_for(r"scheduler\.tasks\.schedule_pass\[.*\] received")
    assert Attempt.objects.filter(job_id__in=ids).count() == 12
    assert JobEvent.objects.filter(job_id__in=ids, to_status="starting").count() == 12
    # Over the whole run, no two attempts ever held one GPU at the same time.
    spans: dict[int, list[tuple[Any, Any, int]]] = defaultdict(list)
    for a in Allocation.objects.filter(attempt__job_id__in=ids):
        spans[a.gpu_id].append((a.allocated_at, a.released_at, a.attempt_id))
    for gpu_spans in spans.values():
        gpu_spans.sort()
        for (_, end, owner), (start, _, other) in itertools.pairwise(gpu_spans):
            assert owner == other or end <= start, gpu_spans
