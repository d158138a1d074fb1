"""Scheduling passes under real concurrency on PostgreSQL: racing passes never
double-allocate (starts batched, or one by one as when a batch fails), and
schedule_pass_body is single-flight with a rerun flag."""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Any
from unittest import mock

import psycopg
import pytest
from django.db import IntegrityError, connection

from scheduler import pass_requests, pass_runner
from scheduler.models import Allocation, Attempt, Gpu, Job
from scheduler.services import starts
from tests.conftest import make_node
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.capture import Broker

THREADS = 4


def _race(target: Any, n: int) -> tuple[list[Any], list[BaseException]]:
    barrier = threading.Barrier(n)
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(target())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a pass hung"
    return results, errors


def _assert_no_double_allocation() -> None:
    live = list(Allocation.objects.filter(released_at__isnull=True))
    slots = Counter((a.gpu_id, a.slot) for a in live)
    assert all(n == 1 for n in slots.values()), slots
    owners: dict[int, set[int]] = {}
    for a in live:
        owners.setdefault(a.gpu_id, set()).add(a.attempt_id)
    assert all(len(attempts) == 1 for attempts in owners.values()), owners


@pytest.fixture(params=["batched", "one-by-one"])
def start_path(request: pytest.FixtureRequest) -> Any:
    """Starts applied as one batch per pass, or (as when a batch fails) each in its
    own savepoint."""
    if request.param == "batched":
        yield
        return
    real = starts._start_batch

    def batch_fails(batch: list[Any], **kwargs: Any) -> int:
        if len(batch) > 1:
            raise IntegrityError("forced: start one by one")
        return real(batch, **kwargs)

    with mock.patch.object(starts, "_start_batch", side_effect=batch_fails):
        yield


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("shape", [(1,), (1, 2)], ids=["1-gpu", "mixed"])
def test_it_never_double_allocates_in_parallel_passes(
    alice: User, shape: tuple[int, ...], start_path: None
) -> None:
    make_node("node-a", 4)
    make_node("node-b", 2)
    make_node("node-c", 2)
    jobs = [JobFactory(owner=alice, gpus=shape[i % len(shape)]) for i in range(24)]

    results, errors = _race(pass_runner.run_one_pass, THREADS)

    assert errors == []
    _assert_no_double_allocation()
    started = Job.objects.filter(status=Job.Status.STARTING)
    assert sum(r["started"] for r in results) == started.count() > 0
    used = 0
    for job in started:
        [attempt] = Attempt.objects.filter(job=job, ended_at__isnull=True)
        gpus = Gpu.objects.filter(allocations__attempt=attempt).distinct()
        assert gpus.count() == job.gpus
        assert {g.node_id for g in gpus} == {attempt.node_id}
        assert all(attempt.allocations.filter(gpu=g).count() == g.slots for g in gpus)
        used += job.gpus
    busy = (
        Allocation.objects.filter(released_at__isnull=True)
        .values("gpu_id")
        .distinct()
        .count()
    )
    assert busy == used <= 8
    assert Job.objects.filter(status=Job.Status.PENDING).count() == (
        len(jobs) - started.count()
    )
    assert not Attempt.objects.filter(job__status=Job.Status.PENDING).exists()


@pytest.mark.django_db(transaction=True)
def test_it_fills_every_free_gpu_when_passes_race(
    alice: User, start_path: None
) -> None:
    make_node("node-a", 4)
    make_node("node-b", 2)
    for _ in range(10):
        JobFactory(owner=alice, gpus=1)

    _results, errors = _race(pass_runner.run_one_pass, THREADS)

    assert errors == []
    assert Job.objects.filter(status=Job.Status.STARTING).count() == 6


# ------------------------------------------------------------------ single flight


@pytest.fixture
def redis_flags() -> Any:
    flags = pass_requests._redis_client()
    flags.delete(pass_requests._rerun_key())
    yield flags
    flags.delete(pass_requests._rerun_key())


@pytest.fixture
def other_session() -> Any:
    """A second PostgreSQL session on the test database (another worker)."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params.pop("prepare_threshold", None)
    conn = psycopg.connect(autocommit=True, **params)
    yield conn
    conn.close()


@pytest.mark.django_db(transaction=True)
def test_it_skips_and_flags_a_rerun_while_another_pass_holds_the_lock(
    redis_flags: Any, other_session: Any
) -> None:
    other_session.execute(
        "SELECT pg_advisory_lock(%s)", [pass_runner.SCHEDULE_LOCK_KEY]
    )

    result = pass_runner.schedule_pass_body()

    assert result == {"skipped": "another pass is running", "passes": []}
    assert redis_flags.exists(pass_requests._rerun_key())


@pytest.mark.django_db(transaction=True)
def test_it_runs_once_the_lock_is_free_and_clears_the_flag(
    alice: User, redis_flags: Any, other_session: Any
) -> None:
    make_node("node-a", 2)
    job = JobFactory(owner=alice)
    other_session.execute(
        "SELECT pg_advisory_lock(%s)", [pass_runner.SCHEDULE_LOCK_KEY]
    )
    pass_runner.schedule_pass_body()
    other_session.execute(
        "SELECT pg_advisory_unlock(%s)", [pass_runner.SCHEDULE_LOCK_KEY]
    )

    result = pass_runner.schedule_pass_body()

    job.refresh_from_db()
    assert len(result["passes"]) == 1
    assert result["passes"][0]["started"] == 1
    assert job.status == Job.Status.STARTING
    assert not redis_flags.exists(pass_requests._rerun_key())


@pytest.mark.django_db(transaction=True)
def test_it_releases_the_lock_after_a_pass(
    redis_flags: Any, other_session: Any
) -> None:
    pass_runner.schedule_pass_body()

    row = other_session.execute(
        "SELECT pg_try_advisory_lock(%s)", [pass_runner.SCHEDULE_LOCK_KEY]
    ).fetchone()

    assert row == (True,)


class FakePasses:
    """A fake clock and sleep for ``scheduler.pass_runner``, and passes that each take
    ``took`` s on it, with a submission arriving during the first ``busy`` ones."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, flags: Any, took: float, busy: int
    ) -> None:
        self.clock = 1000.0
        self.slept: list[float] = []
        self.calls: list[float] = []
        self.flags, self.took, self.busy = flags, took, busy
        monkeypatch.setattr(pass_runner.time, "monotonic", lambda: self.clock)
        monkeypatch.setattr(pass_runner.time, "sleep", self.sleep)
        monkeypatch.setattr(pass_runner, "run_one_pass", self.one_pass)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock += seconds

    def one_pass(self) -> dict[str, Any]:
        self.calls.append(self.clock)
        self.clock += self.took
        if len(self.calls) <= self.busy:
            self.flags.set(pass_requests._rerun_key(), "1")
        return {"started": 0}


@pytest.mark.django_db(transaction=True)
def test_a_rerun_waits_for_the_spacing_and_a_first_pass_never_does(
    redis_flags: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass asked for during a pass (a burst of submissions) starts
    GPULAB_PASS_MIN_SPACING s after the previous one started, not back to back."""
    settings.GPULAB_PASS_MIN_SPACING = 30.0
    fake = FakePasses(monkeypatch, redis_flags, took=2.0, busy=1)

    result = pass_runner.schedule_pass_body()

    assert len(result["passes"]) == 2
    assert fake.slept == [28.0]  # nothing before the first pass
    assert fake.calls == [1000.0, 1030.0]


@pytest.mark.django_db(transaction=True)
def test_pass_requests_while_one_is_queued_enqueue_it_once(
    redis_flags: Any, monkeypatch: pytest.MonkeyPatch, passes: Broker
) -> None:
    """A burst of submissions enqueues one pass, not one each; once that pass
    begins (before it loads anything) the next request enqueues another."""
    from scheduler.services.common import request_pass

    queued_when_a_pass_ran: list[bool] = []

    def one_pass() -> dict[str, Any]:
        queued_when_a_pass_ran.append(
            bool(redis_flags.exists(pass_requests._queued_key()))
        )
        return {"started": 0}

    monkeypatch.setattr(pass_runner, "run_one_pass", one_pass)
    for _ in range(5):
        request_pass()
    assert passes.passes() == 1
    # if its task were lost, requests would enqueue again within the TTL
    assert (
        0 < redis_flags.ttl(pass_requests._queued_key()) <= pass_requests.QUEUED_TTL_S
    )

    pass_runner.schedule_pass_body()  # the queued pass runs
    request_pass()
    request_pass()

    assert passes.passes() == 2
    # the mark was cleared before the pass loaded the state
    assert queued_when_a_pass_ran == [False]


@pytest.mark.django_db(transaction=True)
def test_a_long_pass_is_followed_by_a_rest_as_long_as_itself(
    redis_flags: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passes that take longer than the spacing (thousands of waiting jobs) hold
    at most half of the time: a rerun starts no sooner after a pass ended than
    that pass took."""
    settings.GPULAB_PASS_MIN_SPACING = 1.0
    fake = FakePasses(monkeypatch, redis_flags, took=5.0, busy=2)

    pass_runner.schedule_pass_body()

    assert fake.calls == [1000.0, 1010.0, 1020.0]
    assert fake.slept == [5.0, 5.0]


@pytest.mark.django_db(transaction=True)
def test_a_task_that_finds_a_pass_running_leaves_it_marked_queued(
    redis_flags: Any, other_session: Any, passes: Broker
) -> None:
    """Under a burst, the tasks that found the lock taken each cleared the mark,
    so every next submission enqueued one more: the running pass's next round
    covers them, and it clears the mark itself before it loads the state."""
    from scheduler.services.common import request_pass

    other_session.execute(
        "SELECT pg_advisory_lock(%s)", [pass_runner.SCHEDULE_LOCK_KEY]
    )
    request_pass()

    assert pass_runner.schedule_pass_body()["skipped"] == "another pass is running"
    request_pass()

    assert passes.passes() == 1
    assert redis_flags.exists(pass_requests._rerun_key())
    other_session.execute(
        "SELECT pg_advisory_unlock(%s)", [pass_runner.SCHEDULE_LOCK_KEY]
    )
    pass_runner.schedule_pass_body()  # the holder's next round
    request_pass()
    assert passes.passes() == 2
