"""Helpers for the node agent tests: a module of its own (not conftest.py) so that
importing it never picks up another directory's conftest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import Server, ServerConnection, serve

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agents.protocol import parse_agent_message  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from agents.agent import Agent

DURABLE = {"job.started", "job.exited", "job.log"}
# What the portal acks: the durable frames, metrics and progress (droppable ones).
ACKED = DURABLE | {"metrics", "job.progress"}


def wait_until(
    pred: Callable[[], Any], timeout: float = 10.0, step: float = 0.02
) -> Any:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {pred}")
        time.sleep(step)


async def await_until(
    pred: Callable[[], Any], timeout: float = 10.0, step: float = 0.02
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {pred}")
        await asyncio.sleep(step)


class Portal:
    """A loopback websocket server playing the portal's side of the protocol.

    Every frame is validated with ``parse_agent_message`` and recorded with the
    number of the connection it came on. Durable frames and metrics are acked with
    their own seq while ``acking`` is True, as the real server does.
    """

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.headers: list[str | None] = []
        self.extensions: list[str | None] = []
        self.paths: list[str] = []
        self.connections = 0
        self.acking = True
        self.port = 0
        self.server: Server | None = None
        self.conn: ServerConnection | None = None
        self.out_seq = 0

    async def start(self) -> None:
        self.server = await serve(self._handler, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
            self.conn = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def _handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        number = self.connections
        self.conn = ws
        self.headers.append(ws.request.headers.get("Authorization"))
        self.extensions.append(ws.request.headers.get("Sec-WebSocket-Extensions"))
        self.paths.append(ws.request.path)
        with contextlib.suppress(Exception):
            async for raw in ws:
                parse_agent_message(raw)  # raises on anything off-contract
                frame = json.loads(raw)
                frame["conn"] = number
                self.frames.append(frame)
                if self.acking and frame["type"] in ACKED:
                    await self.send("ack", {"seq": frame["seq"]})

    async def send(self, type_: str, data: dict[str, Any]) -> None:
        assert self.conn is not None
        self.out_seq += 1
        await self.conn.send(
            json.dumps(
                {
                    "type": type_,
                    "v": 2,
                    "seq": self.out_seq,
                    "ts": time.time(),
                    "data": data,
                }
            )
        )

    def of(self, type_: str, **match: Any) -> list[dict[str, Any]]:
        return [
            f
            for f in self.frames
            if f["type"] == type_
            and all(f["data"].get(k) == v for k, v in match.items())
        ]


def launch_data(
    attempt_id: int, command: str, workdir: str | Path, **extra: Any
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "attempt_id": attempt_id,
        "attempt": 1,
        "job_id": attempt_id + 1000,
        "name": f"job {attempt_id}",
        "command": command,
        "workdir": str(workdir),
        "env": {},
        "gpu_uuids": [],
        "grace_s": 5,
    }
    data.update(extra)
    return data


def make_agent(url: str, state_dir: Path, **overrides: Any) -> Agent:
    """An in-process agent over a simulated 2-GPU node, with test-speed timings."""
    from agents.agent import Agent, Config
    from agents.nvml import NvmlReader
    from agents.simulate import SimNvml
    from agents.spec import parse_node_spec

    sim = SimNvml(parse_node_spec("2xA100-80GB"), hostname="node-t")
    settings: dict[str, Any] = {
        "heartbeat_s": 0.2,
        "sample_interval_s": 0.1,
        "backoff_base_s": 0.05,
        "backoff_cap_s": 0.2,
        "reap_interval_s": 0.05,
        "allow_root_jobs": True,
        "hostname": "node-t",
    }
    settings.update(overrides)
    config = Config(
        server=url + "/ws/agent/", token="tok-123", state_dir=state_dir, **settings
    )
    return Agent(config, NvmlReader(sim), sim)


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.shutdown.set()
        await asyncio.wait_for(task, 5)
