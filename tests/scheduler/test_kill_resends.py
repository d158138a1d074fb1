"""A kill is never lost, and a node is judged lost only on time the portal could
hear it: ``services.resend_kills``, the hello's re-sent kills, the web tier's
hearing pulse and ``services.mark_lost_nodes`` reading it, on the real database
and the real channel layer (the frames an agent would get are read from its
group)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth.models import Permission
from django.utils import timezone

from agents import protocol
from scheduler import events, services
from scheduler.models import Attempt, Job, JobEvent, Node, PortalHearing
from scheduler.services.presence import hearing_gap, pulse_hearing
from tests.conftest import hello_data
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

LOST_AFTER = timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER)


class AgentInbox:
    """The frames sent to a node's agent, read from its Channels group."""

    def __init__(self, node_id: int) -> None:
        self.layer = get_channel_layer()
        self.group = events.agent_group(node_id)
        # A plain channel name (no process-local "!" part): read without a
        # receive buffer, so each read may run on an event loop of its own.
        self.channel = f"test-agent-inbox.{uuid.uuid4().hex}"
        async_to_sync(self.layer.group_add)(self.group, self.channel)

    def frames(self) -> list[protocol.ServerMessage]:
        """Every frame received so far (none waits once the sends are done: the
        after-commit callbacks ran before this is called)."""

        async def drain() -> list[dict[str, Any]]:
            got = []
            while True:
                try:
                    got.append(
                        await asyncio.wait_for(self.layer.receive(self.channel), 0.3)
                    )
                except TimeoutError:
                    return got

        return [
            protocol.parse_server_message(_json(m["frame"]))
            for m in async_to_sync(drain)()
        ]

    def close(self) -> None:
        async_to_sync(self.layer.group_discard)(self.group, self.channel)


def _json(frame: dict[str, Any]) -> str:
    import json

    return json.dumps(frame)


@pytest.fixture
def inbox(cluster: list[Node]) -> Iterator[AgentInbox]:
    box = AgentInbox(cluster[0].pk)
    yield box
    box.close()


@pytest.fixture
def commit(django_capture_on_commit_callbacks: Any) -> Any:
    """Run the after-commit callbacks (the sends) of what the test does."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def running(job: Job, node: Node) -> Attempt:
    attempt = start_job(job, node)
    assert services.mark_started(
        node.pk, started_data(attempt, timezone.now().timestamp())
    )
    attempt.refresh_from_db()
    return attempt


def kills(frames: list[protocol.ServerMessage]) -> list[tuple[int, str]]:
    return [
        (f.data.attempt_id, f.data.reason)
        for f in frames
        if isinstance(f, protocol.JobKill)
    ]


def resent_events(job: Job) -> list[str]:
    return list(
        JobEvent.objects.filter(job=job, message__contains="kill re-sent").values_list(
            "message", flat=True
        )
    )


def due(attempt: Attempt) -> datetime:
    """When the attempt's kill is overdue: its grace and the resend delay after
    it went."""
    assert attempt.kill_sent_at is not None
    return attempt.kill_sent_at + timedelta(
        seconds=attempt.job.kill_grace_s + settings.GPULAB_KILL_RESEND_AFTER
    )


# ------------------------------------------------------------------ resend_kills


def test_a_kill_no_exit_answers_is_sent_again_once_overdue(
    alice: User, cluster: list[Node], inbox: AgentInbox, commit: Any
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, kill_grace_s=10)
    attempt = running(job, node)
    with commit():
        services.cancel_job(job.pk, by=alice)
    attempt.refresh_from_db()
    assert kills(inbox.frames()) == [(attempt.pk, "cancelled")]
    assert attempt.kill_sent_at is not None

    with time_machine.travel(due(attempt) - timedelta(seconds=1), tick=False), commit():
        early = services.resend_kills()
    assert early == []  # within its grace and the delay: the exit may still come
    assert inbox.frames() == []

    with time_machine.travel(due(attempt), tick=False):
        with commit():
            first = services.resend_kills()
        with commit():
            again = services.resend_kills()  # the same beat tick, twice
    assert (first, again) == ([attempt.pk], [])
    assert kills(inbox.frames()) == [(attempt.pk, "cancelled")]
    attempt.refresh_from_db()
    assert attempt.kill_resends == 1
    [event] = resent_events(job)
    assert "node-a" in event and "cancelled" in event

    # Still no exit: sent again each period, with no second event.
    with time_machine.travel(due(attempt), tick=False), commit():
        assert services.resend_kills() == [attempt.pk]
    attempt.refresh_from_db()
    assert attempt.kill_resends == 2
    assert kills(inbox.frames()) == [(attempt.pk, "cancelled")]
    assert len(resent_events(job)) == 1

    # The exit comes back: the attempt ends and nothing is sent any more.
    services.finish_attempt(node.pk, exited_data(attempt, 143, reason="killed"))
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED
    with time_machine.travel(due(attempt) + timedelta(hours=1), tick=False), commit():
        assert services.resend_kills() == []
    assert inbox.frames() == []


@pytest.mark.parametrize("how", ["requeue", "preempt"])
def test_every_kind_of_stop_records_its_kill_and_is_resent(
    how: str,
    alice: User,
    admin_user: User,
    cluster: list[Node],
    inbox: AgentInbox,
    commit: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    with commit():
        if how == "requeue":
            admin_user.user_permissions.add(
                Permission.objects.get(codename="requeue_job")
            )
            admin_user = type(admin_user).objects.get(pk=admin_user.pk)
            services.requeue_job(job.pk, by=admin_user)
            reason = "requeued"
        else:
            from scheduler import policy

            services.apply_decisions([policy.Preempt(job.pk, 0, "a higher class")])
            reason = "preempted"
    attempt.refresh_from_db()
    assert attempt.kill_reason == reason
    assert kills(inbox.frames()) == [(attempt.pk, reason)]

    with time_machine.travel(due(attempt), tick=False), commit():
        assert services.resend_kills() == [attempt.pk]
    assert kills(inbox.frames()) == [(attempt.pk, reason)]


def test_a_kill_waits_for_its_node_to_be_connected(
    alice: User, cluster: list[Node], inbox: AgentInbox, commit: Any
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    with commit():
        services.cancel_job(job.pk, by=alice)
    inbox.frames()
    attempt.refresh_from_db()
    services.record_disconnect(node.pk)

    with time_machine.travel(due(attempt), tick=False), commit():
        assert services.resend_kills() == []
    assert inbox.frames() == []
    attempt.refresh_from_db()
    assert attempt.kill_resends == 0

    # Back: its hello lists the attempt, which gets its kill again at once.
    hello = hello_data(4, host="node-a").model_copy(
        update={"running": [protocol.RunningJob(attempt_id=attempt.pk, job_id=job.pk)]}
    )
    back = due(attempt)
    with time_machine.travel(back, tick=False):
        commands = services.record_hello(node.pk, hello).commands
    assert kills([protocol.parse_server_message(_json(c)) for c in commands]) == [
        (attempt.pk, "cancelled")
    ]
    attempt.refresh_from_db()
    assert attempt.kill_sent_at == back  # the next re-send counts from the hello


def test_an_attempt_no_one_asked_to_stop_gets_no_kill(
    alice: User, cluster: list[Node], inbox: AgentInbox, commit: Any
) -> None:
    job = JobFactory(owner=alice)
    running(job, cluster[0])

    with time_machine.travel(timezone.now() + timedelta(days=1), tick=False), commit():
        assert services.resend_kills() == []
    assert inbox.frames() == []


def test_only_the_ranks_that_have_not_exited_get_the_kill_again(
    alice: User, cluster: list[Node], inbox: AgentInbox, commit: Any
) -> None:
    node_a, node_b = cluster
    job = JobFactory(owner=alice)
    attempt = running(job, node_a)
    # A job spanning both nodes whose rank on node-b has exited already.
    Attempt.objects.filter(pk=attempt.pk).update(
        ranks=[node_a.pk, node_b.pk],
        rank_exits={str(node_b.pk): {"exit_code": 0}},
        kill_reason="peer_failed",
        kill_sent_at=timezone.now(),
    )
    attempt.refresh_from_db()
    on_b = AgentInbox(node_b.pk)
    try:
        with time_machine.travel(due(attempt), tick=False), commit():
            assert services.resend_kills() == [attempt.pk]
        assert kills(inbox.frames()) == [(attempt.pk, "peer_failed")]
        assert on_b.frames() == []
    finally:
        on_b.close()


# ------------------------------------------------------------------ record_hello


def test_hello_resends_the_kill_of_an_attempt_being_stopped_it_still_runs(
    alice: User, cluster: list[Node], inbox: AgentInbox, commit: Any
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    with commit():
        services.cancel_job(job.pk, by=alice)
    other = running(JobFactory(owner=alice), node)  # not being stopped
    hello = hello_data(4, host="node-a").model_copy(
        update={
            "running": [
                protocol.RunningJob(attempt_id=attempt.pk, job_id=job.pk),
                protocol.RunningJob(attempt_id=other.pk, job_id=other.job_id),
            ]
        }
    )

    commands = services.record_hello(node.pk, hello).commands

    frames = [protocol.parse_server_message(_json(c)) for c in commands]
    assert kills(frames) == [(attempt.pk, "cancelled")]
    assert not [f for f in frames if isinstance(f, protocol.JobLaunch)]


# ------------------------------------------------------------------ hearing


def test_pulses_without_a_gap_keep_one_run_of_hearing() -> None:
    t0 = timezone.now()
    assert pulse_hearing(t0) is True  # the first pulse ever starts a run
    step = hearing_gap() - timedelta(seconds=1)
    assert pulse_hearing(t0 + step) is False
    assert pulse_hearing(t0 + 2 * step) is False
    # Another web process's pulse, a little behind, changes nothing.
    assert pulse_hearing(t0 + step) is False

    hearing = PortalHearing.objects.get()
    assert (hearing.hearing_since, hearing.heard_at) == (t0, t0 + 2 * step)

    later = t0 + 2 * step + hearing_gap() + timedelta(seconds=1)
    assert pulse_hearing(later) is True  # after a gap: a new run
    hearing.refresh_from_db()
    assert (hearing.hearing_since, hearing.heard_at) == (later, later)


def hear(start: datetime, end: datetime) -> None:
    """Web processes pulse from ``start`` to ``end`` without a gap."""
    step = hearing_gap() / 2
    at = start
    while at < end:
        pulse_hearing(at)
        at += step
    pulse_hearing(end)


def test_a_node_silent_while_the_portal_hears_is_lost(
    alice: User, cluster: list[Node], commit: Any
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    running(job, node)
    t0 = timezone.now()
    hear(t0, t0 + LOST_AFTER + timedelta(seconds=1))

    with (
        time_machine.travel(t0 + LOST_AFTER + timedelta(seconds=1), tick=False),
        commit(),
    ):
        lost = services.mark_lost_nodes()

    assert node.pk in lost
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


def test_a_portal_outage_longer_than_the_timeout_loses_no_node(
    alice: User, cluster: list[Node], commit: Any
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = running(job, node)
    t0 = timezone.now()
    pulse_hearing(t0)
    back = t0 + 3 * LOST_AFTER  # no web process pulsed meanwhile

    # The judge (beat, worker) is back before the web tier: nobody is judged.
    with time_machine.travel(back, tick=False), commit():
        assert services.mark_lost_nodes() == []
    # The web tier is back: the silence counts from now on only.
    hear(back, back + LOST_AFTER - timedelta(seconds=1))
    with (
        time_machine.travel(back + LOST_AFTER - timedelta(seconds=1), tick=False),
        commit(),
    ):
        assert services.mark_lost_nodes() == []
    node.refresh_from_db()
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert node.status == Node.Status.UP
    assert (job.status, attempt.ended_at) == (Job.Status.RUNNING, None)

    # Heard for the whole timeout since, still silent: now it is lost.
    hear(back + LOST_AFTER - timedelta(seconds=1), back + LOST_AFTER)
    with time_machine.travel(back + LOST_AFTER + timedelta(seconds=1), tick=False):
        pulse_hearing()
        with commit():
            lost = services.mark_lost_nodes()
    assert sorted(lost) == sorted(n.pk for n in cluster)  # node-b is silent too
