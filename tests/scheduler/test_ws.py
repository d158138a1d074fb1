"""``scheduler.ws.PeerGoneSafe``: a consumer whose peer went while it handled a
message still runs its ``disconnect`` (the server raises an OSError for the send,
ASGI, and queues the disconnect). The agent socket's own case on a real uvicorn is
tests/scheduler/test_agent_consumer_server.py; here, the mixin on the real Channels
consumer class with the run's Redis channel layer, and its place in every consumer
of the portal."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.generic.websocket import AsyncWebsocketConsumer

from portal.consumers import DashboardConsumer
from portal.terminal.consumers import TerminalConsumer
from scheduler.consumers import AgentConsumer
from scheduler.ws import PeerGoneSafe

pytestmark = pytest.mark.anyio


class Replier(PeerGoneSafe, AsyncWebsocketConsumer):
    """Answers every message twice, records its disconnect."""

    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self.log = log

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None
    ) -> None:
        await self.send(text_data="first")
        await self.send(text_data="second")

    def on_peer_gone(self) -> None:
        self.log.append("gone")

    async def disconnect(self, code: int) -> None:
        self.log.append(("disconnect", code))


async def test_a_send_to_a_gone_peer_is_dropped_and_the_disconnect_still_runs() -> None:
    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for message in (
        {"type": "websocket.connect"},
        {"type": "websocket.receive", "text": "hello"},
        {"type": "websocket.disconnect", "code": 1006},
    ):
        incoming.put_nowait(message)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "websocket.send":
            # The socket closed meanwhile: what uvicorn raises (ClientDisconnected).
            raise OSError("client disconnected")
        sent.append(message)

    log: list[Any] = []
    scope = {"type": "websocket", "path": "/ws/x/", "headers": [], "subprotocols": []}
    app = Replier.as_asgi(log=log)
    await asyncio.wait_for(app(scope, incoming.get, send), 10)

    assert [m["type"] for m in sent] == ["websocket.accept"]
    # the second send is dropped without trying; the disconnect ran after
    assert log == ["gone", ("disconnect", 1006)]


@pytest.mark.parametrize(
    "consumer", [AgentConsumer, DashboardConsumer, TerminalConsumer]
)
def test_every_websocket_consumer_drops_sends_to_a_gone_peer(consumer: type) -> None:
    mro = consumer.__mro__
    assert mro.index(PeerGoneSafe) < mro.index(AsyncWebsocketConsumer)
