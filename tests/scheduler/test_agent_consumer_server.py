"""The agent websocket under a real ASGI server (uvicorn, as the web process runs
it), on this run's PostgreSQL and Redis: what the in-memory communicator cannot
show, a client whose TCP connection ends while the consumer is handling its frame
(an agent killed, a host that crashed)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import TYPE_CHECKING

import pytest
import uvicorn
from channels.db import database_sync_to_async
from django.db import connection, connections, transaction
from websockets.sync.client import ClientConnection, connect

from agents import protocol
from portal.asgi import application
from scheduler import services
from scheduler.models import Node
from tests.conftest import hello_data
from tests.e2e.conftest import free_port, wait_until
from tests.factories import agent_frame

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.django_db(transaction=True)


class Served:
    """``portal.asgi.application`` served by uvicorn on a thread of its own."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                application,
                host="127.0.0.1",
                port=self.port,
                lifespan="off",
                log_level="warning",
            )
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),))

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def start(self) -> None:
        self.thread.start()
        wait_until(lambda: self.server.started, what="uvicorn listening")

    def stop(self) -> None:
        # The consumers' database thread keeps a connection: closed (on that
        # thread) so that the test database can be emptied and dropped.
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(
            database_sync_to_async(connections.close_all)(), self.loop
        ).result(10)
        self.server.should_exit = True
        self.thread.join(10)

    def connections(self) -> int:
        return len(self.server.server_state.connections)


@pytest.fixture
def served(transactional_db: None) -> Iterator[Served]:
    served = Served()
    served.start()
    yield served
    served.stop()


def agent(served: Served, token: str) -> ClientConnection:
    return connect(
        f"ws://127.0.0.1:{served.port}/ws/agent/",
        additional_headers={"Authorization": f"Bearer {token}"},
        open_timeout=10,
    )


def acked(ws: ClientConnection, seq: int) -> None:
    """Wait for the ack of ``seq`` (frames before it were handled)."""
    while True:
        frame = protocol.parse_server_message(ws.recv(timeout=10))
        if isinstance(frame, protocol.Ack) and frame.data.seq == seq:
            return


def waiting_on_a_lock() -> bool:
    """Some session of this database waits for a row lock (ours)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def test_an_agent_gone_while_its_frame_is_handled_is_recorded_disconnected(
    served: Served,
) -> None:
    """The agent dies while the consumer stores its metrics frame (the database is
    slow: here a row lock holds it up). The consumer's ack then finds no client
    (the server raises, as ASGI says it does for a send after the client left);
    the disconnect the server delivered next must still be handled: the node is
    recorded disconnected, not left connected for ever."""
    node, token = services.create_node("node-gone")
    with agent(served, token) as ws:
        ws.send(agent_frame(protocol.Hello, hello_data(2, host="node-gone"), 1))
        log = protocol.JobLogData(
            attempt_id=999_999, job_id=999_999, offset=0, data="x"
        )
        ws.send(agent_frame(protocol.JobLog, log, 2))
        acked(ws, 2)
        assert Node.objects.get(pk=node.pk).connected

        with transaction.atomic():
            Node.objects.select_for_update().get(pk=node.pk)
            # The first metrics frame is stored (history) before its ack: the
            # consumer waits on the node's row.
            metrics = protocol.MetricsData(sampled_at=1_700_000_000.0, gpus=[])
            ws.send(agent_frame(protocol.Metrics, metrics, 3))
            wait_until(waiting_on_a_lock, what="the consumer waiting on the row")
            # The agent's process dies: its kernel closes the socket (FIN), with
            # no close frame.
            ws.socket.shutdown(socket.SHUT_RDWR)
            wait_until(lambda: served.connections() == 0, what="the server's EOF")

    wait_until(
        lambda: not Node.objects.get(pk=node.pk).connected,
        timeout=15,
        what="the node recorded disconnected",
    )
