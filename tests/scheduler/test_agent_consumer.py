"""The agent websocket (/ws/agent/): token auth, frame validation with error replies
that keep the connection usable, acks of durable messages, commands from the
channel layer, and a connection that survives idle periods."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections

from agents import protocol
from agents.protocol import CloseCode
from portal.asgi import application
from scheduler import events, services
from scheduler.models import (
    Attempt,
    Gpu,
    GpuSample,
    Job,
    JobEvent,
    Node,
    ProgressSample,
    UsageRecord,
)
from tests.conftest import hello_data, make_node
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
    """The consumer's database thread keeps a connection; close it so the test
    database can be dropped at the end of the run."""
    yield
    await database_sync_to_async(connections.close_all)()


@pytest.fixture
def new_node(transactional_db: None) -> tuple[Node, str]:
    """Registered, never connected."""
    return services.create_node("node-x")


@pytest.fixture
def nodes(transactional_db: None) -> dict[str, tuple[Node, str]]:
    return {"a": make_node("node-a", 4), "b": make_node("node-b", 2)}


@pytest.fixture
def starting(alice: User, nodes: dict[str, tuple[Node, str]]) -> Attempt:
    """A job allocated on node-a, not yet started by its agent."""
    job = JobFactory(owner=alice)
    return start_job(job, nodes["a"][0])


async def agent(token: str | None) -> WebsocketCommunicator:
    headers = [(b"authorization", b"Bearer " + token.encode())] if token else []
    comm = WebsocketCommunicator(application, "/ws/agent/", headers=headers)
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    return comm


async def receive(comm: WebsocketCommunicator) -> dict[str, Any]:
    frame = await comm.receive_json_from(timeout=TIMEOUT)
    protocol.parse_server_message(json.dumps(frame))  # what the agent would do
    return frame


async def send_durable(comm: WebsocketCommunicator, seq: int) -> None:
    """A durable frame the server ignores (a log chunk of no attempt of this node)
    and its ack: a barrier proving every earlier frame was handled."""
    data = protocol.JobLogData(attempt_id=999_999, job_id=999_999, offset=0, data="x")
    await comm.send_to(text_data=agent_frame(protocol.JobLog, data, seq))
    ack = await receive(comm)
    assert ack["type"] == "ack"
    assert ack["data"] == {"seq": seq}


def db(fn: Any) -> Any:
    return database_sync_to_async(fn)


async def fetch(model: Any, pk: int) -> Any:
    return await db(model.objects.get)(pk=pk)


# ------------------------------------------------------------------ auth


@pytest.mark.parametrize("token", [None, "not-the-token"], ids=["none", "wrong"])
async def test_it_closes_4401_and_stores_nothing_without_the_right_token(
    new_node: tuple[Node, str], token: str | None
) -> None:
    node, _ = new_node
    comm = await agent(token)
    await comm.send_to(
        text_data=agent_frame(protocol.Hello, hello_data(2, host="node-x"), 1)
    )

    closed = await comm.receive_output(timeout=TIMEOUT)

    assert closed["type"] == "websocket.close"
    assert closed["code"] == CloseCode.BAD_TOKEN
    node = await fetch(Node, node.pk)
    assert node.status == Node.Status.NEW
    assert await db(Gpu.objects.filter(node=node).count)() == 0


async def test_it_brings_a_node_up_on_hello(new_node: tuple[Node, str]) -> None:
    node, token = new_node
    hello = hello_data(2, host="node-x")
    comm = await agent(token)

    await comm.send_to(text_data=agent_frame(protocol.Hello, hello, 1))
    await send_durable(comm, 2)

    node = await fetch(Node, node.pk)
    assert (node.status, node.connected) == (Node.Status.UP, True)
    assert node.incarnation == hello.incarnation
    uuids = await db(lambda: list(node.gpus.values_list("uuid", flat=True)))()
    assert uuids == [g.uuid for g in hello.gpus]
    await comm.disconnect()


async def test_it_marks_the_node_disconnected_when_the_socket_closes(
    nodes: dict[str, tuple[Node, str]],
) -> None:
    node, token = nodes["a"]
    comm = await agent(token)
    await comm.send_to(text_data=agent_frame(protocol.Heartbeat, {}, 1))
    await send_durable(comm, 2)

    await comm.disconnect()

    assert (await fetch(Node, node.pk)).connected is False


# ------------------------------------------------------------------ bad frames


BAD_FRAMES = [
    pytest.param("{not json", "json", id="malformed-json"),
    pytest.param(
        '{"type": "bogus", "v": 2, "seq": 1, "ts": 1.0, "data": {}}',
        "bogus",
        id="unknown-type",
    ),
    pytest.param(
        '{"type": "heartbeat", "v": 2, "seq": 1, "ts": 1.0,'
        ' "data": {"running": [], "extra": 1}}',
        "extra",
        id="unknown-field",
    ),
    pytest.param(
        '{"type": "job.started", "v": 2, "seq": 1, "ts": 1.0, "data":'
        ' {"attempt_id": 1, "job_id": 1, "pid": "12", "started_at": 1.0}}',
        "pid",
        id="wrong-type",
    ),
    pytest.param(
        '{"type": "job.progress", "v": 2, "seq": 1, "ts": 1.0, "data":'
        ' {"attempt_id": 1, "job_id": 1, "at": 1.0, "step": -3}}',
        "step",
        id="negative-step",
    ),
    pytest.param(
        '{"type": "job.progress", "v": 2, "seq": 1, "ts": 1.0, "data":'
        ' {"attempt_id": 1, "job_id": 1, "at": 1.0, "step": 1,'
        ' "total": 9223372036854775808}}',
        "total",
        id="step-past-bigint",
    ),
    pytest.param('["hello"]', "", id="not-an-object"),
    pytest.param(
        '{"type": "metrics", "v": 2, "seq": 1, "ts": 1.0, "data": {"sampled_at":'
        ' 1.0, "gpus": [{"index": 0, "uuid": "GPU-x", "temperature_c": NaN}]}}',
        "temperature_c",
        id="nan-temperature",
    ),
    pytest.param(
        '{"type": "metrics", "v": 2, "seq": 1, "ts": 1.0, "data": {"sampled_at":'
        ' 1.0, "gpus": [{"index": 0, "uuid": "GPU-x", "power_w": Infinity}]}}',
        "power_w",
        id="infinite-power",
    ),
    pytest.param(
        '{"type": "metrics", "v": 2, "seq": 1, "ts": 1.0, "data":'
        ' {"sampled_at": 1e308, "gpus": []}}',
        "sampled_at",
        id="sampled-past-year-9999",
    ),
    pytest.param(
        '{"type": "job.exited", "v": 2, "seq": 1, "ts": 1.0, "data": {"attempt_id":'
        ' 1, "job_id": 1, "exit_code": 0, "ended_at": -5.0}}',
        "ended_at",
        id="negative-time",
    ),
]


@pytest.mark.parametrize(("raw", "names"), BAD_FRAMES)
async def test_it_answers_a_bad_frame_with_an_error_and_stays_usable(
    new_node: tuple[Node, str], raw: str, names: str
) -> None:
    node, token = new_node
    comm = await agent(token)

    await comm.send_to(text_data=raw)
    error = await receive(comm)

    assert error["type"] == "error"
    assert error["data"]["code"] == "bad_message"
    assert names in error["data"]["detail"].lower()
    await comm.send_to(text_data=agent_frame(protocol.Heartbeat, {}, 5))
    await send_durable(comm, 6)
    assert (await fetch(Node, node.pk)).connected is True  # the heartbeat landed
    await comm.disconnect()


async def test_it_closes_4400_on_an_unsupported_protocol_version(
    new_node: tuple[Node, str],
) -> None:
    """An agent older than the launch frame's Unix numbers (version 1) is refused
    with both versions named."""
    _, token = new_node
    comm = await agent(token)

    await comm.send_to(
        text_data='{"type": "heartbeat", "v": 1, "seq": 1, "ts": 1.0, "data": {}}'
    )
    error = await comm.receive_json_from(timeout=TIMEOUT)
    closed = await comm.receive_output(timeout=TIMEOUT)

    assert error["type"] == "error"
    assert error["data"]["code"] == "unsupported_version"
    assert "protocol version 1 is not supported" in error["data"]["detail"]
    assert "speaks 2" in error["data"]["detail"]
    assert closed["type"] == "websocket.close"
    assert closed["code"] == CloseCode.BAD_VERSION


# ------------------------------------------------------------------ job messages


async def test_it_ignores_but_acks_reports_for_another_nodes_attempt(
    nodes: dict[str, tuple[Node, str]], starting: Attempt
) -> None:
    _, token_b = nodes["b"]
    comm = await agent(token_b)

    await comm.send_to(
        text_data=agent_frame(protocol.JobStarted, started_data(starting), 7)
    )
    started_ack = await receive(comm)
    await comm.send_to(
        text_data=agent_frame(protocol.JobExited, exited_data(starting, 0), 8)
    )
    exited_ack = await receive(comm)

    assert started_ack["data"] == {"seq": 7}
    assert exited_ack["data"] == {"seq": 8}
    job = await fetch(Job, starting.job_id)
    attempt = await fetch(Attempt, starting.pk)
    assert job.status == Job.Status.STARTING
    assert (attempt.started_at, attempt.ended_at) == (None, None)
    await comm.disconnect()


async def test_it_runs_and_ends_a_job_once_for_a_duplicate_exit(
    nodes: dict[str, tuple[Node, str]], starting: Attempt
) -> None:
    _, token = nodes["a"]
    comm = await agent(token)
    exited = agent_frame(protocol.JobExited, exited_data(starting, 0), 2)

    await comm.send_to(
        text_data=agent_frame(protocol.JobStarted, started_data(starting), 1)
    )
    acks = [(await receive(comm))["data"]["seq"]]
    await comm.send_to(text_data=exited)
    acks.append((await receive(comm))["data"]["seq"])
    await comm.send_to(text_data=exited)  # a replay after a lost ack
    acks.append((await receive(comm))["data"]["seq"])

    assert acks == [1, 2, 2]
    job = await fetch(Job, starting.job_id)
    assert job.status == Job.Status.COMPLETED
    terminal = JobEvent.objects.filter(job_id=job.pk, to_status="completed")
    assert await db(terminal.count)() == 1
    usage = UsageRecord.objects.filter(attempt_id=starting.pk)
    assert await db(usage.count)() == 1
    await comm.disconnect()


async def test_it_stores_a_log_chunk_and_acks_it(
    nodes: dict[str, tuple[Node, str]], starting: Attempt
) -> None:
    _, token = nodes["a"]
    comm = await agent(token)
    chunk = protocol.JobLogData(
        attempt_id=starting.pk, job_id=starting.job_id, offset=0, data="epoch 1\n"
    )

    await comm.send_to(text_data=agent_frame(protocol.JobLog, chunk, 3))
    ack = await receive(comm)

    assert ack["data"] == {"seq": 3}
    job = await fetch(Job, starting.job_id)
    assert await db(services.log_tail)(job) == "epoch 1\n"
    await comm.disconnect()


def progress(attempt: Attempt, step: int, at: float) -> protocol.JobProgressData:
    return protocol.JobProgressData(
        attempt_id=attempt.pk, job_id=attempt.job_id, at=at, step=step, total=50
    )


async def test_it_stores_progress_once_when_it_is_replayed(
    nodes: dict[str, tuple[Node, str]], starting: Attempt
) -> None:
    _, token = nodes["a"]
    comm = await agent(token)
    now = time.time()
    first = agent_frame(protocol.JobProgress, progress(starting, 10, now - 20), 4)
    second = agent_frame(protocol.JobProgress, progress(starting, 30, now - 10), 5)

    acks = []
    for frame in (first, second, first, second):  # then a replay of both
        await comm.send_to(text_data=frame)
        acks.append((await receive(comm))["data"]["seq"])

    assert acks == [4, 5, 4, 5]
    attempt = await fetch(Attempt, starting.pk)
    assert (attempt.progress_step, attempt.progress_total) == (30, 50)
    assert attempt.progress_rate() == pytest.approx(2.0)
    samples = ProgressSample.objects.filter(attempt_id=starting.pk)
    assert await db(samples.count)() == 1
    await comm.disconnect()


async def test_it_refuses_progress_of_another_nodes_attempt_with_an_error(
    nodes: dict[str, tuple[Node, str]], starting: Attempt
) -> None:
    _, token_b = nodes["b"]
    comm = await agent(token_b)

    await comm.send_to(
        text_data=agent_frame(
            protocol.JobProgress, progress(starting, 10, time.time()), 9
        )
    )
    error = await receive(comm)
    ack = await receive(comm)

    assert error["type"] == "error"
    assert error["data"]["code"] == "refused"
    assert f"attempt {starting.pk}" in error["data"]["detail"]
    assert ack["type"] == "ack"  # handled: the agent need not replay it
    assert ack["data"] == {"seq": 9}
    attempt = await fetch(Attempt, starting.pk)
    assert attempt.progress_step is None
    assert not await db(ProgressSample.objects.exists)()
    await send_durable(comm, 10)  # the connection is still usable
    await comm.disconnect()


# ------------------------------------------------------------------ commands


async def test_it_forwards_a_command_sent_from_sync_code(
    nodes: dict[str, tuple[Node, str]], starting: Attempt
) -> None:
    node, token = nodes["a"]
    comm = await agent(token)
    job = await fetch(Job, starting.job_id)
    gpus = await db(lambda: list(Gpu.objects.filter(allocations__attempt=starting)))()
    gpus = list({g.pk: g for g in gpus}.values())
    command = await db(services.launch_frame)(job, starting, gpus)

    await db(events.send_to_agent)(node.pk, command)
    frame = await receive(comm)

    assert frame["type"] == "job.launch"
    assert frame["seq"] == 1  # stamped by the consumer
    assert frame["data"]["attempt_id"] == starting.pk
    assert frame["data"]["gpu_uuids"] == [gpus[0].uuid]
    await comm.disconnect()


async def test_it_delivers_the_launch_of_a_job_started_while_connected(
    alice: User, nodes: dict[str, tuple[Node, str]]
) -> None:
    node, token = nodes["b"]
    comm = await agent(token)
    job = await db(JobFactory)(owner=alice, gpus=2)

    attempt = await db(start_job)(job, node)
    frame = await receive(comm)

    assert frame["type"] == "job.launch"
    assert frame["data"]["attempt_id"] == attempt.pk
    assert len(frame["data"]["gpu_uuids"]) == 2
    await comm.disconnect()


async def test_it_sends_reconcile_commands_in_reply_to_hello(
    nodes: dict[str, tuple[Node, str]], starting: Attempt
) -> None:
    _, token = nodes["a"]
    comm = await agent(token)

    await comm.send_to(
        text_data=agent_frame(protocol.Hello, hello_data(4, host="node-a"), 1)
    )
    frame = await receive(comm)

    assert frame["type"] == "job.launch"
    assert frame["data"]["attempt_id"] == starting.pk
    await comm.disconnect()


async def test_it_still_talks_after_a_quiet_spell_longer_than_5s(
    nodes: dict[str, tuple[Node, str]],
) -> None:
    """redis-py 8 pitfall: a 5 s socket timeout on the channel layer's connection
    breaks a receive that waited longer. The quiet period is the point of the test."""
    node, token = nodes["a"]
    comm = await agent(token)
    await send_durable(comm, 1)

    await anyio.sleep(7)
    await comm.send_to(text_data=agent_frame(protocol.Heartbeat, {}, 2))
    await send_durable(comm, 3)
    drain = events.frame(protocol.NodeDrain, protocol.EmptyData())
    await db(events.send_to_agent)(node.pk, drain)
    command = await receive(comm)

    assert command["type"] == "node.drain"
    await comm.disconnect()


async def test_it_keeps_metrics_live_and_persists_one_sample_per_interval(
    nodes: dict[str, tuple[Node, str]], settings: Any
) -> None:
    """Every frame updates the live state and is acked; one per
    GPULAB_METRICS_PERSIST_INTERVAL reaches the history; a replay is stored once."""
    settings.GPULAB_METRICS_PERSIST_INTERVAL = 10
    node, token = nodes["a"]
    gpu = await db(node.gpus.get)(index=1)
    t0 = (time.time() // 10) * 10 - 30 + 1  # 1 s into a 10 s interval, 30 s ago
    comm = await agent(token)

    async def send_metrics(seq: int, at: float, util: float) -> None:
        sample = protocol.GpuSample(index=1, uuid=gpu.uuid, util_gpu=util)
        metrics = protocol.MetricsData(sampled_at=at, gpus=[sample])
        await comm.send_to(text_data=agent_frame(protocol.Metrics, metrics, seq))
        ack = await receive(comm)
        assert ack == {**ack, "type": "ack", "data": {"seq": seq}}

    await send_metrics(1, t0, 10.0)  # persisted: first of its interval
    await send_metrics(2, t0 + 2, 20.0)  # same interval: live only
    await send_metrics(3, t0 + 10, 30.0)  # next interval: persisted
    await send_metrics(4, t0, 10.0)  # a replay of the first: stored once

    stored = await db(
        lambda: list(
            GpuSample.objects.filter(gpu_id=gpu.pk)
            .order_by("at")
            .values_list("at", "util_gpu")
        )
    )()
    assert [(a.timestamp(), u) for a, u in stored] == [(t0, 10.0), (t0 + 10, 30.0)]
    gpu = await fetch(Gpu, gpu.pk)
    assert gpu.latest["util_gpu"] == 30.0  # the replay did not overwrite the present
    await comm.disconnect()


async def test_it_closes_the_older_connection_when_a_node_reconnects(
    nodes: dict[str, tuple[Node, str]],
) -> None:
    node, token = nodes["a"]
    old = await agent(token)

    new = await agent(token)
    closed = await old.receive_output(timeout=TIMEOUT)
    drain = events.frame(protocol.NodeDrain, protocol.EmptyData())
    await db(events.send_to_agent)(node.pk, drain)
    command = await receive(new)

    assert closed["type"] == "websocket.close"
    assert closed["code"] == CloseCode.REPLACED
    assert command["type"] == "node.drain"
    await new.disconnect()
