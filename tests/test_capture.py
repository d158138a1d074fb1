"""The capture fixtures read what the product really sent through Redis: the
frames of nodes created after the fixture started, a revocation kept apart from
command frames, only what was sent after commit, and one queued pass per burst."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from scheduler import events, services
from scheduler.services.common import request_pass
from tests.conftest import make_node

if TYPE_CHECKING:
    from tests.capture import AgentFrames, Broker, Channels

pytestmark = pytest.mark.django_db


def test_it_reads_the_frames_of_a_node_created_after_it_started(
    sent: AgentFrames,
) -> None:
    node, _ = make_node("late", 1)
    other, _ = make_node("other", 1)

    events.send_to_agent(node.pk, {"type": "job.kill", "data": {"attempt_id": 7}})
    events.send_to_agent(other.pk, {"type": "job.launch", "data": {"job_id": 8}})
    events.send_to_agent(node.pk, {"type": "job.kill", "data": {"attempt_id": 9}})

    assert sent.calls() == [
        (node.pk, {"type": "job.kill", "data": {"attempt_id": 7}}),
        (other.pk, {"type": "job.launch", "data": {"job_id": 8}}),
        (node.pk, {"type": "job.kill", "data": {"attempt_id": 9}}),
    ]
    assert [f["data"]["attempt_id"] for f in sent.frames(node.pk)] == [7, 9]
    assert [n for n, _ in sent.of_type("job.launch")] == [other.pk]
    sent.clear()
    assert sent.calls() == []


def test_a_token_rotation_is_a_revocation_not_a_command_and_only_after_commit(
    sent: AgentFrames, django_capture_on_commit_callbacks: Any
) -> None:
    node, _ = make_node("rotated", 1)

    with django_capture_on_commit_callbacks(execute=True):
        services.rotate_node_token(node.pk)
        assert sent.revocations() == []

    node.refresh_from_db()
    assert sent.revocations() == [(node.pk, node.token_hash)]
    assert sent.calls() == []


def test_a_job_status_broadcast_reaches_a_joined_group(channels: Channels) -> None:
    channels.join(events.job_group(41))

    events.broadcast_job_status(41, "running", "started on node-a")
    events.broadcast_job_status(42, "running", "not listened to")

    assert channels.messages(events.job_group(41)) == [
        {
            "type": "job.status",
            "job_id": 41,
            "status": "running",
            "message": "started on node-a",
        }
    ]


def test_a_burst_of_pass_requests_queues_one_pass(passes: Broker) -> None:
    for _ in range(3):
        request_pass()

    assert passes.tasks() == ["scheduler.tasks.schedule_pass"]
    assert passes.passes() == 1
