"""The agent channel (/ws/agent/) against a rogue or broken node, through the real
ASGI application, PostgreSQL and Redis: a rotated token cuts the live connection
and the next connect; a node cannot report for another node's attempt with any
message type; frames over the size limit are refused with a reason; a node over
its rate is throttled (nothing dropped, nothing handled beyond the rate); a
database error closes the connection so the agent replays (never acks a frame it
did not store); a node declared lost must say hello again; a connection whose
group membership lapsed gets it back on its next heartbeat."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest
import redis
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.db import OperationalError, connections

from agents import protocol
from agents.protocol import CloseCode
from portal.asgi import application
from scheduler import events, services
from scheduler.consumers import AgentConsumer
from scheduler.models import (
    Attempt,
    GpuSample,
    Job,
    JobLogChunk,
    Node,
    ProgressSample,
    hash_token,
)
from tests.conftest import make_node
from tests.factories import (
    JobFactory,
    agent_frame,
    exited_data,
    start_job,
    started_data,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.anyio, pytest.mark.django_db(transaction=True)]

TIMEOUT = 5


@pytest.fixture(autouse=True)
async def _close_db_connections() -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


def db(fn: Any) -> Any:
    return database_sync_to_async(fn)


async def agent(token: str) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(
        application,
        "/ws/agent/",
        headers=[(b"authorization", b"Bearer " + token.encode())],
    )
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    return comm


async def receive(comm: WebsocketCommunicator) -> dict[str, Any]:
    frame = await comm.receive_json_from(timeout=TIMEOUT)
    protocol.parse_server_message(json.dumps(frame))
    return frame


async def barrier(comm: WebsocketCommunicator, seq: int) -> list[dict[str, Any]]:
    """A durable frame and its ack: every earlier frame was handled. Returns the
    error frames that came before its ack (earlier acks are dropped)."""
    data = protocol.JobLogData(attempt_id=999_999, job_id=999_999, offset=0, data="x")
    await comm.send_to(text_data=agent_frame(protocol.JobLog, data, seq))
    errors = []
    while (frame := await receive(comm)) != {
        **frame,
        "type": "ack",
        "data": {"seq": seq},
    }:
        if frame["type"] == "error":
            errors.append(frame)
    return errors


async def closed_with(comm: WebsocketCommunicator) -> int:
    while (out := await comm.receive_output(timeout=TIMEOUT))["type"] != (
        "websocket.close"
    ):
        pass
    return int(out["code"])


@pytest.fixture
def nodes(transactional_db: None) -> dict[str, tuple[Node, str]]:
    return {"a": make_node("node-a", 2), "b": make_node("node-b", 2)}


@pytest.fixture
def running(alice: User, nodes: dict[str, tuple[Node, str]]) -> Attempt:
    """Alice's job running on node-a (GPU 0)."""
    node = nodes["a"][0]
    attempt = start_job(JobFactory(owner=alice), node)
    assert services.mark_started(node.pk, started_data(attempt))
    return Attempt.objects.get(pk=attempt.pk)


# ------------------------------------------------------------------ tokens


async def test_a_rotated_token_loses_its_live_connection_and_the_next(
    nodes: dict[str, tuple[Node, str]],
) -> None:
    node, old_token = nodes["a"]
    live = await agent(old_token)
    await barrier(live, 1)

    new_token = await db(services.rotate_node_token)(node.pk)

    assert await closed_with(live) == CloseCode.BAD_TOKEN
    again = await agent(old_token)
    assert await closed_with(again) == CloseCode.BAD_TOKEN
    fresh = await agent(new_token)
    await barrier(fresh, 2)  # the new token works, and is not cut
    await db(services.rotate_node_token)(nodes["b"][0].pk)  # another node's
    await barrier(fresh, 3)
    await fresh.disconnect()


async def test_tokens_are_stored_hashed(nodes: dict[str, tuple[Node, str]]) -> None:
    node, token = nodes["a"]
    stored = await db(lambda: Node.objects.filter(pk=node.pk).values()[0])()

    assert token not in json.dumps(stored, default=str)
    assert stored["token_hash"] == hash_token(token)


# ------------------------------------------------------------------ other nodes' jobs


def other_nodes_frames(attempt: Attempt, gpu_uuid: str) -> dict[str, str]:
    """Every agent message, about node-a's attempt, as node-b would send it."""
    now = time.time()
    progress = protocol.JobProgressData(
        attempt_id=attempt.pk, job_id=attempt.job_id, at=now, step=5, total=10
    )
    log = protocol.JobLogData(
        attempt_id=attempt.pk, job_id=attempt.job_id, offset=0, data="forged\n"
    )
    # On node-b's own GPU, a process said to be node-a's attempt.
    sample = protocol.GpuSample(
        index=0,
        uuid=gpu_uuid,
        util_gpu=99.0,
        processes=[
            protocol.ProcessSample(
                pid=4242, used_memory_mib=70_000, sm_util=99.0, attempt_id=attempt.pk
            )
        ],
    )
    return {
        "job.started": agent_frame(protocol.JobStarted, started_data(attempt), 10),
        "job.exited": agent_frame(protocol.JobExited, exited_data(attempt, 0), 10),
        "job.log": agent_frame(protocol.JobLog, log, 10),
        "job.progress": agent_frame(protocol.JobProgress, progress, 10),
        "metrics": agent_frame(
            protocol.Metrics, protocol.MetricsData(sampled_at=now, gpus=[sample]), 10
        ),
    }


@pytest.mark.parametrize(
    "kind", ["job.started", "job.exited", "job.log", "job.progress", "metrics"]
)
async def test_a_node_cannot_report_for_another_nodes_attempt(
    nodes: dict[str, tuple[Node, str]], running: Attempt, kind: str
) -> None:
    node_b, token_b = nodes["b"]
    gpu_b = await db(node_b.gpus.get)(index=0)
    frame = other_nodes_frames(running, gpu_b.uuid)[kind]
    comm = await agent(token_b)

    await comm.send_to(text_data=frame)
    replies = await barrier(comm, 11)

    if kind == "job.progress":  # refused with the reason
        assert [r["data"]["code"] for r in replies] == ["refused"]
        assert "does not run on this node" in replies[0]["data"]["detail"]
    attempt = await db(Attempt.objects.get)(pk=running.pk)
    job = await db(Job.objects.get)(pk=running.job_id)
    assert job.status == Job.Status.RUNNING
    assert (attempt.ended_at, attempt.rank_starts) == (None, running.rank_starts)
    assert attempt.started_at == running.started_at
    assert (attempt.progress_step, attempt.peak_memory_mib) == (None, None)
    assert not await db(JobLogChunk.objects.filter(attempt=attempt).exists)()
    assert not await db(ProgressSample.objects.filter(attempt=attempt).exists)()
    stored = await db(
        lambda: [
            p.get("attempt_id")
            for s in GpuSample.objects.filter(gpu__node=node_b)
            for p in s.processes
        ]
    )()
    assert stored == ([None] if kind == "metrics" else [])  # kept, as foreign
    await comm.disconnect()


async def test_a_nodes_own_processes_keep_their_attempt(
    nodes: dict[str, tuple[Node, str]], running: Attempt
) -> None:
    # The check above strips only what is not the node's: node-a's frame about
    # its own attempt keeps it, and raises the attempt's peak memory.
    _node_a, token_a = nodes["a"]
    gpu = await db(lambda: running.allocations.select_related("gpu").first().gpu)()
    sample = protocol.GpuSample(
        index=gpu.index,
        uuid=gpu.uuid,
        processes=[
            protocol.ProcessSample(pid=1, used_memory_mib=1234, attempt_id=running.pk)
        ],
    )
    comm = await agent(token_a)
    metrics = protocol.MetricsData(sampled_at=time.time(), gpus=[sample])

    await comm.send_to(text_data=agent_frame(protocol.Metrics, metrics, 1))
    await barrier(comm, 2)

    attempt = await db(Attempt.objects.get)(pk=running.pk)
    assert attempt.peak_memory_mib == 1234
    stored = await db(
        lambda: [
            p["attempt_id"]
            for s in GpuSample.objects.filter(gpu=gpu)
            for p in s.processes
        ]
    )()
    assert stored == [running.pk]
    await comm.disconnect()


# ------------------------------------------------------------------ size, rate


async def test_a_frame_over_the_size_limit_is_refused_and_the_connection_closed(
    nodes: dict[str, tuple[Node, str]], running: Attempt
) -> None:
    _node_a, token_a = nodes["a"]
    comm = await agent(token_a)
    log = protocol.JobLogData(
        attempt_id=running.pk,
        job_id=running.job_id,
        offset=0,
        data="x" * 200_000,
    )
    frame = agent_frame(protocol.JobLog, log, 1)
    frame = frame.replace('"offset":0', '"offset":0' + " " * protocol.MAX_FRAME_BYTES)

    await comm.send_to(text_data=frame)
    error = await receive(comm)

    assert error["data"]["code"] == "too_large"
    assert (
        f"exceeds the limit of {protocol.MAX_FRAME_BYTES} bytes"
        in (error["data"]["detail"])
    )
    assert await closed_with(comm) == CloseCode.TOO_BIG
    assert not await db(JobLogChunk.objects.exists)()


class FakeClock:
    """The throttle's clock and wait: time passes only when the consumer waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


async def test_a_node_over_its_rate_is_throttled_and_loses_nothing(
    nodes: dict[str, tuple[Node, str]], settings: Any
) -> None:
    settings.GPULAB_AGENT_MAX_FRAMES_PER_S = 5
    settings.GPULAB_AGENT_BURST_S = 1  # 5 frames saved up
    _, token = nodes["a"]
    clock = FakeClock()
    with (
        mock.patch.object(AgentConsumer, "_now", staticmethod(clock.monotonic)),
        mock.patch.object(AgentConsumer, "_wait", staticmethod(clock.wait)),
    ):
        comm = await agent(token)
        chunks = [
            agent_frame(
                protocol.JobLog,
                protocol.JobLogData(attempt_id=9, job_id=9, offset=i, data="x"),
                i + 1,
            )
            for i in range(15)
        ]
        for chunk in chunks:  # all at once, as a flood (or a replayed spool)
            await comm.send_to(text_data=chunk)
        replies = [await receive(comm) for _ in range(16)]

    acks = [r["data"]["seq"] for r in replies if r["type"] == "ack"]
    errors = [r for r in replies if r["type"] == "error"]
    assert acks == list(range(1, 16))  # every frame handled, in order
    assert [e["data"]["code"] for e in errors] == ["throttled"]  # said once
    assert "over 5 frames/s" in errors[0]["data"]["detail"]
    assert replies.index(errors[0]) == 5  # after the 5 saved up
    # The 10 frames beyond the burst were each held 1/5 s: 15 frames in 2 s.
    assert clock.waits == pytest.approx([0.2] * 10)
    await comm.disconnect()


# ------------------------------------------------------------------ failures


async def test_a_database_error_closes_without_acking_so_the_agent_replays(
    nodes: dict[str, tuple[Node, str]], running: Attempt
) -> None:
    _, token = nodes["a"]
    comm = await agent(token)
    down = OperationalError("the database system is shutting down")

    with mock.patch.object(services, "finish_attempt", side_effect=down):
        await comm.send_to(
            text_data=agent_frame(protocol.JobExited, exited_data(running, 0), 5)
        )
        code = await closed_with(comm)

    assert code == CloseCode.TRY_AGAIN  # no ack came before the close
    assert (await db(Attempt.objects.get)(pk=running.pk)).ended_at is None
    # The agent's replay on its next connection is stored, once.
    again = await agent(token)
    await again.send_to(
        text_data=agent_frame(protocol.JobExited, exited_data(running, 0), 5)
    )
    assert (await receive(again))["data"] == {"seq": 5}
    assert (await db(Job.objects.get)(pk=running.job_id)).status == "completed"
    await again.disconnect()


async def test_a_heartbeat_from_a_node_declared_lost_makes_it_say_hello(
    nodes: dict[str, tuple[Node, str]],
) -> None:
    node, token = nodes["a"]
    comm = await agent(token)
    await db(Node.objects.filter(pk=node.pk).update)(status=Node.Status.LOST)

    await comm.send_to(text_data=agent_frame(protocol.Heartbeat, {}, 1))

    assert await closed_with(comm) == CloseCode.NODE_LOST


async def test_a_lapsed_group_membership_is_renewed_by_the_next_heartbeat(
    nodes: dict[str, tuple[Node, str]],
) -> None:
    # channels_redis drops a member from a group group_expiry (a day) after it
    # joined, and Redis loses groups when it restarts: a long-lived agent
    # connection would stop getting launches. Age the membership past expiry.
    node, token = nodes["a"]
    comm = await agent(token)
    config = django_settings.CHANNEL_LAYERS["default"]["CONFIG"]
    key = f"{config['prefix']}:group:{events.agent_group(node.pk)}"
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    [(member, _)] = client.zrange(key, 0, -1, withscores=True)
    client.zadd(key, {member: time.time() - 2 * 86400})

    await comm.send_to(text_data=agent_frame(protocol.Heartbeat, {}, 1))
    await barrier(comm, 2)
    drain = events.frame(protocol.NodeDrain, protocol.EmptyData())
    await db(events.send_to_agent)(node.pk, drain)

    assert (await receive(comm))["type"] == "node.drain"
    client.close()
    await comm.disconnect()
