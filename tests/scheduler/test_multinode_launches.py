"""Launches that never arrive (re-sent by the node check, given up after a bound) and
rendezvous ports found busy on rank 0's node (the job is relaunched with a new port).
"""

from __future__ import annotations

import importlib
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, get_args

import pytest
from django.apps import apps as django_apps

from agents import protocol
from scheduler import policy, services, tasks
from scheduler.models import Allocation, Attempt, Job, JobEvent, Node
from tests.conftest import hello_data
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db

T0 = 1_800_000_000.0
DELAY = 30  # GPULAB_LAUNCH_RESEND_AFTER in these tests


@pytest.fixture(autouse=True)
def _settings(settings: Any) -> None:
    settings.GPULAB_LAUNCH_RESEND_AFTER = DELAY
    settings.GPULAB_LAUNCH_RESENDS = 3
    settings.GPULAB_RELAUNCH_MAX = 3


@pytest.fixture
def commit(django_capture_on_commit_callbacks: Any) -> Any:
    """Run the on-commit callbacks (the sends) of what is done under it."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def span(job: Job, a: Node, b: Node) -> Attempt:
    """Start ``job`` across every GPU of node-a (rank 0) and node-b (rank 1)."""
    start = policy.Start(
        job.pk,
        (
            policy.Placement(a.pk, tuple(g.pk for g in a.gpus.order_by("index"))),
            policy.Placement(b.pk, tuple(g.pk for g in b.gpus.order_by("index"))),
        ),
    )
    assert services.apply_decisions([start]).started == 1
    return Attempt.objects.get(job=job, ended_at__isnull=True)


@pytest.fixture
def spanning(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any
) -> tuple[Job, Attempt, Node, Node]:
    """A 6-GPU job across node-a (4 GPUs, rank 0) and node-b (2, rank 1); rank 0
    has started, rank 1's launch was lost."""
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    with commit():
        attempt = span(job, a, b)
    started = attempt.created_at.timestamp() + 1
    assert services.mark_started(a.pk, started_data(attempt, started))
    sent.clear()
    return job, attempt, a, b


def after(attempt: Attempt, seconds: float) -> datetime:
    return attempt.created_at + timedelta(seconds=seconds)


def frames(sent: AgentFrames) -> list[tuple[int, str, dict[str, Any]]]:
    """(node id, frame type, data) of every frame sent to an agent."""
    return [(node, f["type"], f["data"]) for node, f in sent.calls()]


def messages(job: Job) -> list[str]:
    """The job's event messages in the order they were written."""
    return list(
        JobEvent.objects.filter(job=job)
        .order_by("id")
        .values_list("message", flat=True)
    )


# ------------------------------------------------------------------ re-sent launches


def test_a_rank_not_started_after_the_delay_gets_its_launch_again_once_per_period(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    job, attempt, _, b = spanning

    with commit():
        assert services.resend_launches(after(attempt, DELAY - 1)) == []
    assert sent.count() == 0

    with commit():
        assert services.resend_launches(after(attempt, DELAY)) == [attempt.pk]

    [(node, kind, data)] = frames(sent)
    assert (node, kind) == (b.pk, "job.launch")
    attempt.refresh_from_db()
    assert attempt.launch_resends == 1
    assert attempt.launch_resent_at == after(attempt, DELAY)
    assert data["attempt_id"] == attempt.pk
    assert data["env"]["PET_NODE_RANK"] == "1"
    assert data["gpu_uuids"] == [g.uuid for g in b.gpus.order_by("index")]
    assert (
        f"attempt 1 rank 1: launch re-sent to node-b (no start reported {DELAY} s "
        "after the launch; re-send 1 of 3)" in messages(job)
    )

    # The check runs every 10 s: within one delay, nothing more is sent.
    with commit():
        for seconds in (DELAY + 10, DELAY + 20, 2 * DELAY - 1):
            assert services.resend_launches(after(attempt, seconds)) == []
    assert sent.count() == 1

    attempt.refresh_from_db()
    assert attempt.launch_resends == 1

    with commit():
        assert services.resend_launches(after(attempt, 2 * DELAY)) == [attempt.pk]
    assert sent.count() == 2
    assert "re-send 2 of 3" in messages(job)[-1]
    attempt.refresh_from_db()
    assert attempt.launch_resends == 2
    assert attempt.launch_resent_at == after(attempt, 2 * DELAY)


def test_a_rank_that_started_or_exited_gets_nothing(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    job, attempt, _, b = spanning
    with commit():
        services.resend_launches(after(attempt, DELAY))
    assert sent.count() == 1

    assert services.mark_started(b.pk, started_data(attempt, T0 + 40))

    attempt.refresh_from_db()
    assert attempt.rank_starts[str(b.pk)] == {"started_at": T0 + 40, "pid": 4242}
    with commit():
        assert services.resend_launches(after(attempt, 10 * DELAY)) == []
    assert sent.count() == 1
    assert "attempt 1 rank 1: running on node-b (pid 4242)" in messages(job)


def test_a_rank_that_exited_is_not_launched_again(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any
) -> None:
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    with commit():
        attempt = span(job, a, b)
    # Rank 1 ran and ended cleanly; rank 0 never reported anything.
    assert services.finish_attempt(b.pk, exited_data(attempt, 0, at=T0))
    sent.clear()

    with commit():
        assert services.resend_launches(after(attempt, DELAY)) == [attempt.pk]

    assert [(n, k) for n, k, _ in frames(sent)] == [(a.pk, "job.launch")]


def test_a_replayed_rank_start_is_recorded_once(
    spanning: tuple[Job, Attempt, Node, Node],
) -> None:
    job, attempt, a, b = spanning
    rank0 = attempt.created_at.timestamp() + 1  # the fixture's start of rank 0

    assert services.mark_started(b.pk, started_data(attempt, T0 + 1))
    assert not services.mark_started(b.pk, started_data(attempt, T0 + 2))
    assert not services.mark_started(a.pk, started_data(attempt, T0))

    attempt.refresh_from_db()
    assert attempt.rank_starts == {
        str(a.pk): {"started_at": rank0, "pid": 4242},
        str(b.pk): {"started_at": T0 + 1, "pid": 4242},
    }
    # The attempt's own start is its first rank's.
    assert attempt.started_at == after(attempt, 1)
    starts = [m for m in messages(job) if ": running on " in m]
    assert starts == [
        "attempt 1 rank 0: running on node-a (pid 4242)",
        "attempt 1 rank 1: running on node-b (pid 4242)",
    ]
    transitions = JobEvent.objects.filter(job=job, to_status=Job.Status.RUNNING)
    assert transitions.count() == 1


def test_a_disconnected_node_gets_no_launch_and_its_wait_does_not_count(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    _, attempt, _, b = spanning
    services.record_disconnect(b.pk)

    with commit():
        for k in range(1, 10):
            assert services.resend_launches(after(attempt, k * DELAY)) == []
    assert sent.count() == 0
    assert Attempt.objects.get(pk=attempt.pk).ended_at is None

    # Back (a heartbeat; its hello would re-send the launch itself): resent now.
    services.record_heartbeat(b.pk)
    with commit():
        assert services.resend_launches(after(attempt, 10 * DELAY)) == [attempt.pk]
    assert [(n, k) for n, k, _ in frames(sent)] == [(b.pk, "job.launch")]


def test_a_lost_node_gets_no_launch(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    _, attempt, _, b = spanning
    Node.objects.filter(pk=b.pk).update(status=Node.Status.LOST)

    with commit():
        assert services.resend_launches(after(attempt, DELAY)) == []
    assert sent.count() == 0


def test_an_attempt_being_stopped_or_cancelled_gets_no_launch(
    spanning: tuple[Job, Attempt, Node, Node],
    alice: User,
    sent: AgentFrames,
    commit: Any,
) -> None:
    job, attempt, _, _ = spanning
    with commit():
        services.cancel_job(job.pk, by=alice)
    sent.clear()

    with commit():
        assert services.resend_launches(after(attempt, 5 * DELAY)) == []
    assert sent.count() == 0


def test_after_its_resends_the_attempt_is_given_up_and_the_job_relaunched(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    job, attempt, a, b = spanning
    with commit():
        for k in range(1, 4):
            assert services.resend_launches(after(attempt, k * DELAY)) == [attempt.pk]
    assert sent.count() == 3
    sent.clear()

    with commit():
        assert services.resend_launches(after(attempt, 4 * DELAY - 1)) == []
        assert services.resend_launches(after(attempt, 4 * DELAY)) == [attempt.pk]

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.ended_at == after(attempt, 4 * DELAY)
    assert attempt.outcome == Attempt.Outcome.LAUNCH_LOST
    assert attempt.launch_resends == 3
    assert job.status == Job.Status.PENDING
    assert not Allocation.objects.filter(attempt=attempt, released_at__isnull=True)
    # Every rank that may run is told to stop; no launch goes out any more.
    assert sorted((n, k, d["reason"]) for n, k, d in frames(sent)) == sorted(
        [(a.pk, "job.kill", "stale"), (b.pk, "job.kill", "stale")]
    )
    assert messages(job)[-1] == (
        "rank 1 of attempt 1 on node-b reported no start after 3 re-sent launches; "
        "relaunching (relaunch 1 of at most 3)"
    )
    sent.clear()
    with commit():
        assert services.resend_launches(after(attempt, 100 * DELAY)) == []
    assert sent.count() == 0
    # The ranks' late exits change nothing.
    assert not services.finish_attempt(a.pk, exited_data(attempt, 143, reason="killed"))
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


def test_a_job_whose_attempts_keep_losing_their_launch_fails_after_the_bound(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any, settings: Any
) -> None:
    settings.GPULAB_LAUNCH_RESENDS = 0
    settings.GPULAB_RELAUNCH_MAX = 1
    node = cluster[0]
    job = JobFactory(owner=alice, gpus=1)

    first = start_job(job, node)
    with commit():
        assert services.resend_launches(after(first, DELAY)) == [first.pk]
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING

    second = start_job(job, node)
    with commit():
        assert services.resend_launches(after(second, DELAY)) == [second.pk]

    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert job.end_reason == (
        "attempt 2 on node-a reported no start after 0 re-sent launches; "
        "not relaunched: 2 attempts could not launch"
    )
    assert job.finished_at is not None


def test_a_single_node_attempt_never_started_gets_its_launch_again(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any
) -> None:
    node = cluster[1]
    job = JobFactory(owner=alice, gpus=2)
    attempt = start_job(job, node)

    with commit():
        assert services.resend_launches(after(attempt, DELAY)) == [attempt.pk]

    [(to, kind, data)] = frames(sent)
    assert (to, kind, data["attempt_id"]) == (node.pk, "job.launch", attempt.pk)
    assert "PET_NODE_RANK" not in data["env"]
    assert messages(job)[-1].startswith("attempt 1: launch re-sent to node-b (")

    services.mark_started(node.pk, started_data(attempt, T0))
    attempt.refresh_from_db()
    assert attempt.rank_starts == {str(node.pk): {"started_at": T0, "pid": 4242}}
    assert attempt.started_at == datetime.fromtimestamp(T0, tz=UTC)
    with commit():
        assert services.resend_launches(after(attempt, 10 * DELAY)) == []
    assert sent.count() == 1


def test_the_node_check_task_resends_launches(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    _, attempt, _, b = spanning
    Attempt.objects.filter(pk=attempt.pk).update(
        created_at=attempt.created_at - timedelta(seconds=DELAY)
    )

    with commit():
        result = tasks.check_nodes()

    assert result["launches_resent"] == [attempt.pk]
    assert [(n, k) for n, k, _ in frames(sent)] == [(b.pk, "job.launch")]


# ------------------------------------------------------------------ state in the attempt


def fake_events(job: Job, *messages: str) -> None:
    """Job events as the timeline words them, but saying what did not happen."""
    JobEvent.objects.bulk_create(
        [JobEvent(job=job, message=m, source=JobEvent.Source.SYSTEM) for m in messages]
    )


def test_a_rank_start_in_the_attempt_alone_stops_its_resends(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    """No job event at all: the decisions come from ``rank_starts``."""
    job, attempt, a, b = spanning
    JobEvent.objects.filter(job=job).delete()

    with commit():
        assert services.resend_launches(after(attempt, DELAY)) == [attempt.pk]
    # Only rank 1: rank 0's start is in the attempt, though its event is gone.
    assert [(n, k) for n, k, _ in frames(sent)] == [(b.pk, "job.launch")]

    attempt.refresh_from_db()
    Attempt.objects.filter(pk=attempt.pk).update(
        rank_starts={
            **attempt.rank_starts,
            str(b.pk): {"started_at": T0, "pid": 7},
        }
    )
    with commit():
        assert services.resend_launches(after(attempt, 10 * DELAY)) == []
    assert sent.count() == 1
    # ... and a start reported again is a replay, events or not.
    assert not services.mark_started(b.pk, started_data(attempt, T0 + 5))
    assert not services.mark_started(a.pk, started_data(attempt, T0 + 5))


def test_the_resend_count_in_the_attempt_alone_decides_when_to_give_up(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    job, attempt, _, _ = spanning
    JobEvent.objects.filter(job=job).delete()
    Attempt.objects.filter(pk=attempt.pk).update(
        launch_resends=3, launch_resent_at=after(attempt, 5 * DELAY)
    )

    with commit():
        # The delay runs from the last round, not from the launch.
        assert services.resend_launches(after(attempt, 6 * DELAY - 1)) == []
        assert services.resend_launches(after(attempt, 6 * DELAY)) == [attempt.pk]

    attempt.refresh_from_db()
    assert attempt.outcome == Attempt.Outcome.LAUNCH_LOST
    assert "job.launch" not in {k for _, k, _ in frames(sent)}
    assert messages(job)[-1].startswith(
        "rank 1 of attempt 1 on node-b reported no start after 3 re-sent launches; "
    )


def test_job_event_text_cannot_change_a_decision(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames, commit: Any
) -> None:
    """Events that say rank 1 started and was re-sent three times (what the job
    timeline would show) neither stop its re-send nor give the attempt up, nor make
    its real start a replay: only the attempt's fields count."""
    job, attempt, _, b = spanning
    resent = "attempt 1 rank 1: launch re-sent to node-b (re-send {} of 3)"
    fake_events(
        job,
        "attempt 1 rank 1: running on node-b (pid 1)",
        *(resent.format(k) for k in (1, 2, 3)),
    )

    with commit():
        assert services.resend_launches(after(attempt, DELAY)) == [attempt.pk]

    assert [(n, k) for n, k, _ in frames(sent)] == [(b.pk, "job.launch")]
    attempt.refresh_from_db()
    assert (attempt.ended_at, attempt.launch_resends) == (None, 1)
    assert services.mark_started(b.pk, started_data(attempt, T0 + 40))
    attempt.refresh_from_db()
    assert str(b.pk) in attempt.rank_starts


def test_every_way_an_attempt_ends_is_an_outcome_choice() -> None:
    """What ``finish_attempt`` stores (the agent's exit reason) and what the portal
    ends attempts with are all ``Attempt.Outcome`` values, so the admin's filter and
    ``full_clean`` know them."""
    field = Attempt._meta.get_field("outcome")
    portal_own = {Attempt.Outcome.NODE_LOST, Attempt.Outcome.LAUNCH_LOST}
    reasons = set(get_args(protocol.ExitReason))

    assert set(Attempt.Outcome.values) == reasons | portal_own
    assert set(Attempt.UNLAUNCHED) <= set(Attempt.Outcome.values)
    for value in Attempt.Outcome.values:
        field.clean(value, None)


def test_the_migration_gives_single_node_attempts_their_start_and_leaves_spans_empty(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any
) -> None:
    """Attempts live at deploy (0007): a single-node attempt's ``started_at`` is its
    one rank's start; a spanning attempt's is only its first rank's (which one is
    unknown), so its ranks get one re-send each, which a running rank answers with
    its start: recorded, with no second transition."""
    a, b = cluster
    gpus_a = list(a.gpus.order_by("index"))
    single = start_job(JobFactory(owner=alice, gpus=1), a, gpus_a[:1])
    assert services.mark_started(a.pk, started_data(single, T0))
    spans_job = JobFactory(owner=alice, gpus=5)
    start = policy.Start(
        spans_job.pk,
        (
            policy.Placement(a.pk, tuple(g.pk for g in gpus_a[1:])),
            policy.Placement(b.pk, tuple(g.pk for g in b.gpus.order_by("index"))),
        ),
    )
    with commit():
        assert services.apply_decisions([start]).started == 1
    spans = Attempt.objects.get(job=spans_job, ended_at__isnull=True)
    assert services.mark_started(b.pk, started_data(spans, T0))  # rank 1 first
    Attempt.objects.update(rank_starts={})  # as they were before 0007
    sent.clear()

    migration = importlib.import_module(
        "scheduler.migrations.0007_attempt_launch_state"
    )
    migration.record_single_node_starts(django_apps, None)

    single.refresh_from_db()
    spans.refresh_from_db()
    assert single.rank_starts == {str(a.pk): {"started_at": T0, "pid": 4242}}
    assert spans.rank_starts == {}
    with commit():
        assert services.resend_launches(after(spans, DELAY)) == [spans.pk]
    assert sorted((n, k) for n, k, _ in frames(sent)) == [
        (a.pk, "job.launch"),
        (b.pk, "job.launch"),
    ]
    # Rank 1's agent runs it: it answers the repeated launch with its start.
    assert services.mark_started(b.pk, started_data(spans, T0))
    spans.refresh_from_db()
    spans_job.refresh_from_db()
    assert spans.rank_starts == {str(b.pk): {"started_at": T0, "pid": 4242}}
    assert spans_job.status == Job.Status.RUNNING
    running = JobEvent.objects.filter(job=spans_job, to_status=Job.Status.RUNNING)
    assert running.count() == 1


# ------------------------------------------------------------------ busy rendezvous port


def busy(attempt: Attempt, port: int) -> protocol.JobExitedData:
    return exited_data(
        attempt,
        None,
        at=T0,
        reason="port_busy",
        message=f"rendezvous port {port} busy (0.0.0.0: Address already in use)",
    )


def test_a_busy_rendezvous_port_relaunches_the_job_with_a_new_attempt_and_port(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any
) -> None:
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    with commit():
        attempt = span(job, a, b)
    port = {d["env"]["MASTER_PORT"] for _, _, d in frames(sent)}.pop()
    services.mark_started(b.pk, started_data(attempt, T0 - 1))  # rank 1 waits
    sent.clear()

    # Rank 0's agent found the port taken and launched nothing.
    with commit():
        assert services.finish_attempt(a.pk, busy(attempt, int(port)))

    assert [(n, k, d["reason"]) for n, k, d in frames(sent)] == [
        (b.pk, "job.kill", "peer_failed")
    ]
    assert messages(job)[-1] == (
        f"rank 0 not started: rendezvous port {port} busy (0.0.0.0: Address already "
        "in use) on node node-a; stopping the other ranks"
    )
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING  # until rank 1 has stopped

    assert services.finish_attempt(b.pk, exited_data(attempt, 143, reason="killed"))

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert attempt.outcome == Attempt.Outcome.PORT_BUSY
    assert job.status == Job.Status.PENDING
    assert job.finished_at is None and job.end_reason == ""
    assert messages(job)[-1] == (
        f"rendezvous port {port} busy (0.0.0.0: Address already in use) on node "
        "node-a; relaunching (relaunch 1 of at most 3)"
    )
    assert not Allocation.objects.filter(attempt=attempt, released_at__isnull=True)

    # The next pass starts a new attempt, whose rendezvous port is another.
    sent.clear()
    with commit():
        again = span(job, a, b)
    assert (again.number, again.pk != attempt.pk) == (2, True)
    ports = {d["env"]["MASTER_PORT"] for _, _, d in frames(sent)}
    assert len(ports) == 1
    assert ports != {port}


def test_a_job_whose_port_keeps_being_busy_fails_after_the_bound(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any, settings: Any
) -> None:
    settings.GPULAB_RELAUNCH_MAX = 1
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    for number in (1, 2):
        with commit():
            attempt = span(job, a, b)
        services.finish_attempt(a.pk, busy(attempt, 29500 + number))
        # Rank 1's kill finds nothing: it answers never_started.
        services.finish_attempt(
            b.pk, exited_data(attempt, None, reason="never_started")
        )
        job.refresh_from_db()
        assert job.status == (Job.Status.PENDING if number == 1 else Job.Status.FAILED)

    assert job.end_reason == (
        "rendezvous port 29502 busy (0.0.0.0: Address already in use) on node "
        "node-a; not relaunched: 2 attempts could not launch"
    )
    assert job.exit_code is None


def test_a_cancel_wins_over_a_busy_port(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any
) -> None:
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    with commit():
        attempt = span(job, a, b)
    services.cancel_job(job.pk, by=alice)

    services.finish_attempt(a.pk, busy(attempt, 29501))
    services.finish_attempt(b.pk, exited_data(attempt, 143, reason="killed"))

    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED


def test_a_rank_node_reconnecting_while_its_attempt_is_stopped_gets_a_kill(
    alice: User, cluster: list[Node], sent: AgentFrames, commit: Any
) -> None:
    """Rank 1's node was away when rank 0 reported the busy port (so it missed its
    kill); at its hello it must not be launched into a dead attempt but told to
    stop it, which its agent answers with an exit, and the attempt ends."""
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    with commit():
        attempt = span(job, a, b)
    services.finish_attempt(a.pk, busy(attempt, 29501))
    hello = hello_data(2, host="node-b")
    hello = hello.model_copy(
        update={
            "gpus": [
                g.model_copy(update={"uuid": gpu.uuid})
                for g, gpu in zip(hello.gpus, b.gpus.order_by("index"), strict=True)
            ]
        }
    )

    result = services.record_hello(b.pk, hello)

    assert [(c["type"], c["data"]["reason"]) for c in result.commands] == [
        ("job.kill", "peer_failed")
    ]
    services.finish_attempt(b.pk, exited_data(attempt, None, reason="never_started"))
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
