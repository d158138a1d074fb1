"""The agent websocket endpoint (``/ws/agent/``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import InterfaceError, OperationalError
from redis.exceptions import RedisError

from agents import protocol
from agents.protocol import CloseCode
from scheduler import events, ingest, live, metrics, services
from scheduler.models import Node
from scheduler.throttle import TokenBucket
from scheduler.ws import PeerGoneSafe

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterable

log = logging.getLogger(__name__)

# PostgreSQL unreachable (Django's wrappers of the driver's errors).
_DB_DOWN = (OperationalError, InterfaceError)


class AgentConsumer(PeerGoneSafe, AsyncWebsocketConsumer):
    """One node agent's connection.

    ``connect`` authenticates the node by the token in ``Authorization: Bearer``
    (never a browser session) and joins ``agent.<node_id>`` to receive commands.
    Every frame is validated once by ``agents.protocol``; a bad frame gets an
    ``error`` reply and is logged, never crashes the consumer; so does a valid one
    the node may not send (``services.FrameRefused``), which is acked all the same.
    Durable messages are acked by seq after they are stored; the services are
    idempotent, so a replayed message changes nothing.

    Its ``live.NodeFeed`` sends the node's metrics (at most one update a second)
    and its jobs' stored output to the dashboards' groups that browsers watch; a
    failure there (Redis away) is logged and never stops the storing or the acks.

    Metrics frames: the live update goes out first, without waiting for the
    database. Then the process's ``ingest.MetricsWriter`` (one for all its
    connections: their frames written in batches) takes it. A frame that starts a
    persistence interval is stored (history and latest state) before its ack; the
    others (nine in ten) only update the GPUs' latest state, the node's newest
    frame of each batch: when the database is slow, frames in between are skipped
    rather than queued, so neither the live path nor the acks wait behind a
    backlog (docs/architecture.md, "Live dashboards").
    """

    node_id: int | None = None
    feed: live.NodeFeed | None = None
    live_failed_at: float = 0.0
    node_name: str = ""
    out_seq: int = 0
    # sampled_at of the last metrics frame persisted to the history.
    last_persisted: float | None = None
    # The hash of the token this connection authenticated with (rotation).
    token_hash: str = ""
    # Set once this side closes: frames still queued are not handled.
    closing: bool = False
    # Per-connection allowance (GPULAB_AGENT_MAX_FRAMES_PER_S / _BYTES_PER_S).
    frame_rate: TokenBucket | None = None
    byte_rate: TokenBucket | None = None
    throttled: bool = False

    def on_peer_gone(self) -> None:
        # Frames still queued cannot be acked: not handled.
        self.closing = True

    @staticmethod
    def _now() -> float:
        """The throttle's clock."""
        return time.monotonic()

    @staticmethod
    async def _wait(seconds: float) -> None:
        """How the throttle waits."""
        await asyncio.sleep(seconds)

    async def connect(self) -> None:
        token = _bearer_token(self.scope.get("headers", []))
        client = self.scope.get("client") or ("?", 0)
        try:
            node = await database_sync_to_async(services.authenticate_node)(token or "")
        except _DB_DOWN as exc:
            log.warning(
                "agent connection from %s: database unavailable (%s); told to retry",
                client[0],
                exc,
            )
            await self.accept()
            await self.close(code=CloseCode.TRY_AGAIN)
            return
        if node is None:
            log.warning(
                "agent connection from %s rejected: %s",
                client[0],
                "no token" if not token else "unknown token",
            )
            # Accept then close so the agent sees a reason code, not a bare 403.
            await self.accept()
            await self.close(code=CloseCode.BAD_TOKEN)
            return
        self.node_id = node.pk
        self.node_name = node.name
        self.token_hash = node.token_hash
        burst = settings.GPULAB_AGENT_BURST_S
        self.frame_rate = TokenBucket(
            settings.GPULAB_AGENT_MAX_FRAMES_PER_S, burst, clock=self._now
        )
        self.byte_rate = TokenBucket(
            settings.GPULAB_AGENT_MAX_BYTES_PER_S, burst, clock=self._now
        )
        group = events.agent_group(node.pk)
        # One agent per node: a new connection replaces any older one (which may be
        # half-open after a network cut), so a job.launch reaches one agent only.
        await self.channel_layer.group_send(
            group, {"type": "agent.replaced", "by": self.channel_name}
        )
        await self.channel_layer.group_add(group, self.channel_name)
        self.feed = live.NodeFeed(node.pk)
        await self.accept()
        log.info("agent of node %s connected from %s", node.name, client[0])

    async def disconnect(self, code: int) -> None:
        if self.feed is not None:
            self.feed.close()
            # The latest state the agent sent is written before we say it left.
            await ingest.writer().flushed(self.feed.node_id)
        if self.node_id is None:
            return
        try:
            await self.channel_layer.group_discard(
                events.agent_group(self.node_id), self.channel_name
            )
            await database_sync_to_async(services.record_disconnect)(self.node_id)
        except (*_DB_DOWN, RedisError, OSError) as exc:
            # Nothing to undo: liveness marks a silent node lost in any case.
            log.warning(
                "agent of node %s: disconnect not recorded: %r", self.node_name, exc
            )
        log.info("agent of node %s disconnected (%s)", self.node_name, code)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None
    ) -> None:
        if self.node_id is None or self.closing:
            return
        raw = text_data if text_data is not None else bytes_data or b""
        if len(raw) > protocol.MAX_FRAME_BYTES:
            log.warning(
                "node %s sent a frame of %d bytes (limit %d); closing",
                self.node_name,
                len(raw),
                protocol.MAX_FRAME_BYTES,
            )
            await self._send_error(
                "too_large",
                f"frame of {len(raw)} bytes exceeds the limit of"
                f" {protocol.MAX_FRAME_BYTES} bytes",
            )
            await self._close(CloseCode.TOO_BIG)
            return
        await self._throttle(len(raw))
        try:
            message = protocol.parse_agent_message(raw)
        except protocol.ProtocolError as exc:
            version = _peek_version(raw)
            if version is not None and version != protocol.PROTOCOL_VERSION:
                await self._send_error(
                    "unsupported_version",
                    f"protocol version {version} is not supported; "
                    f"this server speaks {protocol.PROTOCOL_VERSION}",
                )
                await self.close(code=CloseCode.BAD_VERSION)
                return
            log.warning("bad frame from node %s: %s", self.node_name, exc)
            await self._send_error("bad_message", str(exc))
            return
        try:
            await self._dispatch(message)
        except services.FrameRefused as exc:
            # Well-formed but not this node's to send: say why, and still ack it
            # below so that the agent does not replay it.
            log.warning("node %s: %s refused: %s", self.node_name, message.type, exc)
            await self._send_error("refused", str(exc))
        except _DB_DOWN as exc:
            # Not acked: closing makes the agent reconnect (with backoff) and send
            # it again from its spool once the database is back.
            log.warning(
                "node %s: database unavailable for %s (%s); closing so that the"
                " agent sends it again",
                self.node_name,
                message.type,
                exc,
            )
            await self._close(CloseCode.TRY_AGAIN)
            return
        except Exception:
            # One bad message must not take the node's connection down.
            log.exception("node %s: %s handling failed", self.node_name, message.type)
            await self._send_error("server_error", f"could not handle {message.type}")
            return
        if message.type in protocol.DURABLE_TYPES:
            await self._send(protocol.Ack, protocol.AckData(seq=message.seq))

    async def _dispatch(self, message: protocol.AgentMessage) -> None:
        node_id = self.node_id
        assert node_id is not None
        if isinstance(message, protocol.Hello):
            self._holders_changed()
            result = await database_sync_to_async(services.record_hello)(
                node_id, message.data
            )
            for problem in result.rejected:
                await self._send_error("gpu_rejected", problem)
            for command in result.commands:
                await self._send_frame(command)
        elif isinstance(message, protocol.Heartbeat):
            status = await database_sync_to_async(services.record_heartbeat)(
                node_id, message.data.running
            )
            await self._rejoin(node_id)
            if status == Node.Status.LOST:
                # Requeued (or failed) its jobs already: its agent must say hello,
                # which has it kill the attempts the portal ended.
                log.warning(
                    "node %s was declared lost; closing so that its agent says hello",
                    self.node_name,
                )
                # Its new connection may say hello before this one's disconnect
                # runs: leave the node's state to that one (as when replaced).
                await self.channel_layer.group_discard(
                    events.agent_group(node_id), self.channel_name
                )
                self.node_id = None
                await self._close(CloseCode.NODE_LOST)
        elif isinstance(message, protocol.Metrics):
            if self.feed is not None:
                await self._live(self.feed.offer(message.data))
            sampled_at = message.data.sampled_at
            if metrics.should_persist(self.last_persisted, sampled_at):
                await ingest.writer().store(node_id, message.data)
                self.last_persisted = max(self.last_persisted or 0.0, sampled_at)
            else:
                ingest.writer().offer(node_id, message.data)
        elif isinstance(message, protocol.JobStarted):
            await database_sync_to_async(services.mark_started)(node_id, message.data)
            self._holders_changed()
        elif isinstance(message, protocol.JobExited):
            await database_sync_to_async(services.finish_attempt)(node_id, message.data)
            self._holders_changed()
        elif isinstance(message, protocol.JobLog):
            text = await database_sync_to_async(services.append_log)(
                node_id, message.data
            )
            if text and self.feed is not None:
                await self._live(self.feed.log_chunk(message.data, text))
        elif isinstance(message, protocol.TerminalOutput):
            output: events.TerminalOutputEvent = {
                "type": "terminal.output",
                "data": message.data.data,
                "replay": message.data.replay,
                "n": message.data.n,
            }
            await self._to_viewers(message.data.terminal_id, output)
        elif isinstance(message, protocol.TerminalExit):
            ended: events.TerminalExitEvent = {
                "type": "terminal.exit",
                "code": message.data.code,
                "message": message.data.message,
            }
            await self._to_viewers(message.data.terminal_id, ended)
        elif isinstance(message, protocol.JobProgress):
            stored = await database_sync_to_async(services.record_progress)(
                node_id, message.data
            )
            if stored and self.feed is not None:
                await self._live(self.feed.progress(message.data))

    async def _to_viewers(
        self,
        terminal_id: str,
        event: events.TerminalOutputEvent | events.TerminalExitEvent,
    ) -> None:
        """Hand a terminal's output or end to its viewers (``portal.terminal``);
        with Redis away it is lost (terminal frames are volatile) and logged."""
        try:
            await self.channel_layer.group_send(
                events.terminal_group(terminal_id), dict(event)
            )
        except (RedisError, OSError) as exc:
            log.warning("node %s: terminal output lost: %r", self.node_name, exc)

    def _holders_changed(self) -> None:
        if self.feed is not None:
            self.feed.invalidate()

    async def _live(self, send: Coroutine[Any, Any, None]) -> None:
        """A live update: its failure is logged (once a minute) and swallowed, so
        the dashboards never cost the node its acks."""
        try:
            await send
        except Exception:
            if time.monotonic() - self.live_failed_at > 60:
                self.live_failed_at = time.monotonic()
                log.warning(
                    "node %s: live update failed", self.node_name, exc_info=True
                )

    async def agent_replaced(self, event: dict[str, Any]) -> None:
        """Another connection authenticated as this node: this one is stale."""
        if event["by"] == self.channel_name or self.node_id is None:
            return
        log.warning("agent of node %s replaced by a newer connection", self.node_name)
        await self.channel_layer.group_discard(
            events.agent_group(self.node_id), self.channel_name
        )
        self.node_id = None
        await self.close(code=CloseCode.REPLACED)

    async def agent_revoked(self, event: dict[str, Any]) -> None:
        """The node's token was rotated: a connection made with the old one ends
        (4401, as for a bad token; the agent keeps retrying with what it has)."""
        if self.node_id is None or event["token_hash"] == self.token_hash:
            return
        log.warning("agent of node %s: its token was rotated; closing", self.node_name)
        await self._close(CloseCode.BAD_TOKEN)

    async def _rejoin(self, node_id: int) -> None:
        """Join the node's command group again (on every heartbeat): a membership
        lapses after channels_redis's ``group_expiry`` (a day) and is gone when
        Redis restarts, and a launch sent to the group would then reach nobody."""
        try:
            await self.channel_layer.group_add(
                events.agent_group(node_id), self.channel_name
            )
        except (RedisError, OSError) as exc:
            log.warning("node %s: cannot rejoin its group: %r", self.node_name, exc)

    async def _throttle(self, size: int) -> None:
        """Wait while this connection is over its allowance (frames and bytes per
        second): nothing is dropped, the node is slowed down (TCP pushes back)."""
        assert self.frame_rate is not None and self.byte_rate is not None
        wait = max(self.frame_rate.delay(1), self.byte_rate.delay(size))
        if wait <= 0:
            self.throttled = False
            return
        if not self.throttled:
            self.throttled = True
            log.warning(
                "node %s sends more than %g frames/s or %d bytes/s: throttled",
                self.node_name,
                self.frame_rate.rate,
                int(self.byte_rate.rate),
            )
            await self._send_error(
                "throttled",
                f"over {self.frame_rate.rate:g} frames/s or"
                f" {int(self.byte_rate.rate)} bytes/s: frames are handled at that"
                " rate",
            )
        await self._wait(wait)

    async def _close(self, code: int) -> None:
        self.closing = True
        await self.close(code=code)

    async def agent_command(self, event: dict[str, Any]) -> None:
        """A command for this node's agent (from ``events.send_to_agent``)."""
        # A launch or a kill: the node's GPUs may have other holders now.
        self._holders_changed()
        await self._send_frame(event["frame"])

    async def agent_terminal(self, event: dict[str, Any]) -> None:
        """A ``terminal.*`` frame for this node's agent (``portal.terminal``)."""
        await self._send_frame(event["frame"])

    async def _send_frame(self, frame: dict[str, Any]) -> None:
        self.out_seq += 1
        await self.send(text_data=json.dumps({**frame, "seq": self.out_seq}))

    async def _send(self, model: Callable[..., protocol._Envelope], data: Any) -> None:
        await self._send_frame(events.frame(model, data))

    async def _send_error(self, code: str, detail: str) -> None:
        await self._send(
            protocol.Error, protocol.ErrorData(code=code, detail=detail[:4096])
        )


def _bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _peek_version(raw: str | bytes) -> int | None:
    try:
        data = json.loads(raw)
    except (ValueError, TypeError):
        return None
    version = data.get("v") if isinstance(data, dict) else None
    return version if isinstance(version, int) else None
