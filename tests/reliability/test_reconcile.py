"""The reconciler (``services.reconcile``) on PostgreSQL: what agents say they hold
against what the database says runs.

Reports are recorded at explicit instants (``record_report``, what a heartbeat or
hello does with the portal's clock), so the grace is crossed without waiting."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection
from django.utils import timezone

from scheduler import services
from scheduler.models import AgentSighting, Attempt, Job, JobEvent, UsageRecord
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, start_job
from tests.factories import started_data as started

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db(transaction=True)

GRACE = timedelta(seconds=60)


@pytest.fixture(autouse=True)
def _grace(settings: Any) -> None:
    settings.GPULAB_RECONCILE_GRACE = int(GRACE.total_seconds())


@pytest.fixture
def nodes(db: None) -> dict[str, Node]:
    return {"a": make_node("node-a", 2)[0], "b": make_node("node-b", 2)[0]}


def running_on(node: Node, owner: User, at: datetime, **job: Any) -> Attempt:
    attempt = start_job(JobFactory(owner=owner, **job), node)
    assert services.mark_started(node.pk, started(attempt, at.timestamp()))
    return Attempt.objects.get(pk=attempt.pk)


def reconciler_events(job_id: int) -> list[str]:
    return list(
        JobEvent.objects.filter(job_id=job_id, message__startswith="reconciler:")
        .order_by("id")
        .values_list("message", flat=True)
    )


def kills(sent: AgentFrames) -> list[tuple[int, int, str]]:
    """(node, attempt, reason) of every job.kill sent, read back from the real
    channel layer."""
    return [
        (node_id, frame["data"]["attempt_id"], frame["data"]["reason"])
        for node_id, frame in sent.of_type("job.kill")
    ]


# ------------------------------------------------------------------ stale


def test_an_attempt_held_after_it_ended_is_killed_once_with_an_event(
    alice: User, nodes: dict[str, Node], sent: AgentFrames
) -> None:
    a = nodes["a"]
    t0 = timezone.now()
    attempt = running_on(a, alice, t0 - timedelta(minutes=5))
    services.finish_attempt(a.pk, exited_data(attempt, 0))  # ended in the database

    services.record_report(a.pk, [attempt.pk], t0)
    first = services.reconcile(t0)
    services.record_report(a.pk, [attempt.pk], t0 + GRACE)
    second = services.reconcile(t0 + GRACE)
    services.record_report(a.pk, [attempt.pk], t0 + GRACE + timedelta(seconds=5))
    third = services.reconcile(t0 + GRACE + timedelta(seconds=5))

    assert first["stale"] == []  # noticed only: it may be an exit on its way
    assert second["stale"] == [attempt.pk]
    assert third["stale"] == []  # told already, within a grace
    assert kills(sent) == [(a.pk, attempt.pk, "stale")]
    assert reconciler_events(attempt.job_id) == [
        "reconciler: node node-a still runs attempt 1, which ended (exited);"
        " told to stop it (stale)"
    ]
    assert Job.objects.get(pk=attempt.job_id).status == Job.Status.COMPLETED

    # Still held a grace later: the kill is sent again, with no second event.
    later = t0 + 2 * GRACE + timedelta(seconds=1)
    services.record_report(a.pk, [attempt.pk], later)
    assert services.reconcile(later)["stale"] == [attempt.pk]
    assert len(kills(sent)) == 2
    assert len(reconciler_events(attempt.job_id)) == 1


def test_an_exit_on_its_way_is_not_mistaken_for_a_stale_attempt(
    alice: User, nodes: dict[str, Node], sent: AgentFrames
) -> None:
    a = nodes["a"]
    t0 = timezone.now()
    attempt = running_on(a, alice, t0 - timedelta(minutes=5))
    services.finish_attempt(a.pk, exited_data(attempt, 0))

    services.record_report(a.pk, [attempt.pk], t0)  # its exit not acked yet
    services.reconcile(t0)
    services.record_report(a.pk, [], t0 + GRACE)  # acked: no longer held
    result = services.reconcile(t0 + GRACE)

    assert result == {"stale": [], "lost": []}
    assert kills(sent) == []
    assert reconciler_events(attempt.job_id) == []


def test_another_nodes_attempt_is_stopped_on_the_node_that_holds_it(
    alice: User, nodes: dict[str, Node], sent: AgentFrames
) -> None:
    a, b = nodes["a"], nodes["b"]
    t0 = timezone.now()
    attempt = running_on(a, alice, t0 - timedelta(minutes=5))

    for at in (t0, t0 + GRACE):
        services.record_report(a.pk, [attempt.pk], at)
        services.record_report(b.pk, [attempt.pk], at)
        services.reconcile(at)

    assert kills(sent) == [(b.pk, attempt.pk, "stale")]
    assert reconciler_events(attempt.job_id) == [
        "reconciler: node node-b still runs attempt 1, which is not allocated to it;"
        " told to stop it (stale)"
    ]
    attempt.refresh_from_db()
    assert attempt.ended_at is None  # node-a's run goes on


# ------------------------------------------------------------------ lost


@pytest.mark.parametrize(
    ("on_node_loss", "status"),
    [("requeue", Job.Status.PENDING), ("fail", Job.Status.FAILED)],
)
def test_a_started_attempt_its_agent_no_longer_holds_is_ended_as_lost_once(
    alice: User,
    nodes: dict[str, Node],
    sent: AgentFrames,
    on_node_loss: str,
    status: str,
) -> None:
    a = nodes["a"]
    t0 = timezone.now().replace(microsecond=0)
    start = t0 - timedelta(seconds=40)
    requeue = on_node_loss == "requeue"
    attempt = running_on(a, alice, start, requeue_on_node_loss=requeue)
    services.record_report(a.pk, [attempt.pk], t0)  # last seen running
    services.record_report(a.pk, [], t0 + GRACE)  # e.g. its state dir was wiped

    results = [services.reconcile(t0 + GRACE) for _ in range(2)]

    assert [r["lost"] for r in results] == [[attempt.pk], []]
    attempt.refresh_from_db()
    assert (attempt.outcome, attempt.ended_at) == ("lost", t0)
    job = Job.objects.get(pk=attempt.job_id)
    assert job.status == status
    assert reconciler_events(job.pk) == [
        f"reconciler: the agent of node-a has not listed attempt 1 since"
        f" {t0:%Y-%m-%d %H:%M:%S} UTC (it does not run it); ending it as lost"
    ]
    transitions = JobEvent.objects.filter(job=job, to_status=status)
    assert transitions.count() == 1
    assert "process no longer held by the node's agent" in transitions[0].message
    # Charged for the 40 s it was seen to run, its GPU freed.
    [usage] = UsageRecord.objects.filter(attempt=attempt)
    assert usage.gpu_seconds == pytest.approx(40.0, abs=1e-3)
    assert not attempt.allocations.filter(released_at__isnull=True).exists()


def test_lost_waits_a_grace_after_the_attempt_was_last_listed(
    alice: User, nodes: dict[str, Node], sent: AgentFrames
) -> None:
    a = nodes["a"]
    t0 = timezone.now()
    attempt = running_on(a, alice, t0 - timedelta(minutes=5))
    services.record_report(a.pk, [attempt.pk], t0)
    almost = t0 + GRACE - timedelta(seconds=1)
    services.record_report(a.pk, [], almost)

    assert services.reconcile(almost)["lost"] == []
    attempt.refresh_from_db()
    assert attempt.ended_at is None


@pytest.mark.parametrize("why", ["disconnected", "silent", "never started"])
def test_lost_needs_a_started_attempt_and_a_node_that_reports(
    alice: User, nodes: dict[str, Node], sent: AgentFrames, why: str
) -> None:
    a = nodes["a"]
    t0 = timezone.now()
    if why == "never started":  # resend_launches' business
        attempt = start_job(JobFactory(owner=alice), a)
    else:
        attempt = running_on(a, alice, t0 - timedelta(minutes=5))
    services.record_report(a.pk, [], t0 + GRACE)
    now = t0 + GRACE
    if why == "disconnected":
        services.record_disconnect(a.pk)
    elif why == "silent":  # its last report is older than a grace
        now += GRACE + timedelta(seconds=1)

    assert services.reconcile(now) == {"stale": [], "lost": []}
    attempt.refresh_from_db()
    assert attempt.ended_at is None


def test_a_heartbeat_lists_what_the_agent_holds(
    alice: User, nodes: dict[str, Node]
) -> None:
    a = nodes["a"]
    attempt = running_on(a, alice, timezone.now())

    assert services.record_heartbeat(a.pk, [attempt.pk, 999_999]) == "up"

    seen = set(
        AgentSighting.objects.filter(node=a).values_list("attempt_id", flat=True)
    )
    assert seen == {attempt.pk, 999_999}
    assert (
        a.report.reported_at
        == AgentSighting.objects.get(attempt_id=attempt.pk).last_seen_at
    )


# ------------------------------------------------------------------ concurrency


def _race(target: Any, n: int = 4) -> list[BaseException]:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(timeout=10)
            target()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_reconcilers_running_at_once_repair_each_drift_once(
    alice: User, nodes: dict[str, Node], sent: AgentFrames
) -> None:
    a = nodes["a"]
    t0 = timezone.now()
    ended = running_on(a, alice, t0 - timedelta(minutes=5))
    services.finish_attempt(a.pk, exited_data(ended, 0))
    vanished = running_on(a, alice, t0 - timedelta(minutes=5))
    services.record_report(a.pk, [ended.pk, vanished.pk], t0)
    services.reconcile(t0)  # notices the stale one
    now = t0 + GRACE
    services.record_report(a.pk, [ended.pk], now)

    errors = _race(lambda: services.reconcile(now))

    assert errors == []
    assert kills(sent) == [(a.pk, ended.pk, "stale")]
    assert len(reconciler_events(ended.job_id)) == 1
    assert len(reconciler_events(vanished.job_id)) == 1
    assert Attempt.objects.filter(job_id=vanished.job_id).count() == 1
    requeued = JobEvent.objects.filter(job_id=vanished.job_id, to_status="pending")
    assert requeued.count() == 1
