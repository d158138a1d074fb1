"""The agent's connection to the portal: ``hello``, then the spool replayed and
live frames in seq order, the server's commands handed on, and a reconnect with
exponential backoff and full jitter whenever the link drops.

What it logs is what a person needs, one line each, without tracebacks for the
network's expected errors (``Reachability``): the wait for a portal that is not
up yet, a link lost, a portal unreachable for long, each connection, and a
refused token."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from agents import protocol as p
from agents.core import AGENT_VERSION, AgentCore

log = logging.getLogger(__name__)

LINK_STABLE_S = 30.0  # a link up this long resets the backoff


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, base * 2**attempt))."""
    return random.uniform(0, min(cap, base * 2 ** min(attempt, 32)))


def describe(exc: BaseException) -> str:
    """A network error in a few words, for a log line (no traceback: refused
    connections, timeouts and closed links are expected, not bugs)."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, InvalidStatus):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, ConnectionClosed):
        if exc.rcvd is None:
            return "connection closed without a close frame"
        return f"connection closed, code {exc.rcvd.code}"
    return str(exc) or type(exc).__name__


class Reachability:
    """Whether the portal can be reached, as the log tells it:

    - before the first connection, the first failed try says "waiting for the
      portal at URL" (INFO) and each retry is DEBUG: an agent started with (or
      before) the web server says nothing alarming while it comes up;
    - a link that was up and went down: one WARNING naming why;
    - a portal still unreachable ``warn_after_s`` after the first failed try
      (or after the loss): one WARNING per outage;
    - each connection: INFO, with how long the portal was unreachable after a
      warning.
    """

    def __init__(self, url: str, warn_after_s: float) -> None:
        self.url = url
        self.warn_after_s = warn_after_s
        self.ever_connected = False
        self.down_since: float | None = None  # first failed try, or the loss
        self.warned = False

    def connected(self) -> None:
        if self.warned and self.down_since is not None:
            log.info(
                "connected to %s (unreachable for %.0f s)",
                self.url,
                time.monotonic() - self.down_since,
            )
        else:
            log.info("connected to %s", self.url)
        self.ever_connected = True
        self.down_since = None
        self.warned = False

    def lost(self, why: str) -> None:
        """A link that was up went down."""
        log.warning("link to %s down (%s); reconnecting", self.url, why)
        self.down_since = time.monotonic()
        self.warned = False

    def failed(self, why: str, delay: float) -> None:
        """A try to connect failed with an expected network error; the next is
        in ``delay`` seconds."""
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            if not self.ever_connected:
                log.info("waiting for the portal at %s (%s)", self.url, why)
                return
        elif not self.warned and now - self.down_since >= self.warn_after_s:
            self.warned = True
            log.warning(
                "portal at %s unreachable for %.0f s (%s); still retrying",
                self.url,
                now - self.down_since,
                why,
            )
            return
        log.debug("no connection to %s (%s); retrying in %.1f s", self.url, why, delay)


class Link(AgentCore):
    """The connection half of ``Agent``: the ``link`` loop."""

    def _hello(self) -> p.HelloData:
        return p.HelloData(
            agent_version=AGENT_VERSION,
            hostname=self.hostname,
            incarnation=self.incarnation,
            driver_version=self.reader.driver_version,
            cuda_version=self.reader.cuda_version,
            gpus=self.reader.gpus(),
            running=[
                p.RunningJob(attempt_id=j.attempt_id, job_id=j.job_id, pid=j.pgid)
                for j in self.held()
            ],
        )

    async def _send(
        self, ws: ClientConnection, seq: int, frame: str, *, durable: bool = False
    ) -> None:
        pos = self._send_count
        self._send_count += 1
        if durable:
            self._in_flight += 1
        if self._in_flight:  # an ack for this frame may cover durable ones
            self._sent_pos[seq] = pos
            self._sent.append((pos, seq, durable))
        await ws.send(frame)

    async def _sender(self, ws: ClientConnection) -> None:
        seq, frame = self._frame(p.Hello, self._hello())
        await self._send(ws, seq, frame)
        last = 0
        while True:
            self._wake.clear()
            durable = self.spool.pending(after=last)
            live, self._live = self._live, []
            batch = sorted(
                [(s, f, True) for s, f in durable] + [(s, f, False) for s, f in live]
            )
            for seq, frame, is_durable in batch:
                await self._send(ws, seq, frame, durable=is_durable)
                if is_durable:
                    last = seq
            await self._wake.wait()

    async def _receiver(self, ws: ClientConnection) -> None:
        async for raw in ws:
            try:
                msg = p.parse_server_message(raw)
            except p.ProtocolError as exc:
                log.warning("bad frame from the server: %s", exc)
                continue
            if isinstance(msg, p.JobLaunch):
                self.on_launch(msg.data)
            elif isinstance(msg, p.JobKill):
                self.on_kill(msg.data)
            elif isinstance(
                msg,
                p.TerminalOpen | p.TerminalInput | p.TerminalResize | p.TerminalClose,
            ):
                self.on_terminal(msg)
            elif isinstance(msg, p.Ack):
                self.on_ack(msg.data.seq)
            elif isinstance(msg, p.NodeDrain):
                log.info("server asked to drain this node")
            elif isinstance(msg, p.Error):
                log.warning("server error %s: %s", msg.data.code, msg.data.detail)

    async def _session(self, ws: ClientConnection) -> None:
        """Send and receive until either side fails or the server closes."""
        self._sent_pos, self._live = {}, []
        self._sent.clear()
        self._in_flight = 0
        self._send_count = 0
        self.connected = True
        tasks = [
            asyncio.create_task(self._sender(ws)),
            asyncio.create_task(self._receiver(ws)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise what ended the session
        finally:
            self.connected = False
            self.down_since = self._last_spooled_sample = time.monotonic()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def link(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.token}"}
        reach = Reachability(self.config.server, self.config.warn_unreachable_after_s)
        attempt = 0
        while True:
            up_since: float | None = None
            failure: str | None = None  # why a try to connect failed, if it did
            try:
                async with connect(
                    self.config.server,
                    additional_headers=headers,
                    open_timeout=10,
                    close_timeout=1,
                    max_size=p.MAX_FRAME_BYTES,
                    compression=p.WS_COMPRESSION,
                ) as ws:
                    up_since = time.monotonic()
                    reach.connected()
                    try:
                        await self._session(ws)
                    except asyncio.CancelledError:
                        # Shutdown: say goodbye with 1000, not 1011 (the default
                        # when the context manager exits on an exception).
                        with contextlib.suppress(Exception):
                            await ws.close()
                        raise
                code = ws.close_code
                if code in p.TOKEN_REJECTED:
                    log.error(
                        "server rejected the token (close code %s); retrying", code
                    )
                else:
                    reach.lost(f"closed by the server, code {code}")
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    log.error(
                        "server rejected the token (HTTP %s); check --token-file;"
                        " retrying",
                        status,
                    )
                elif status >= 500:  # a proxy in front of a portal not up yet
                    failure = describe(exc)
                else:
                    log.warning("server refused the websocket: HTTP %s", status)
            except (OSError, TimeoutError, WebSocketException) as exc:
                if (
                    isinstance(exc, ConnectionClosed)
                    and exc.rcvd
                    and exc.rcvd.code in p.TOKEN_REJECTED
                ):
                    log.error(
                        "server rejected the token (close code %s); retrying",
                        exc.rcvd.code,
                    )
                elif up_since is not None:
                    reach.lost(describe(exc))
                else:
                    failure = describe(exc)
            if up_since is not None and time.monotonic() - up_since >= LINK_STABLE_S:
                attempt = 0
            delay = backoff_delay(
                attempt, self.config.backoff_base_s, self.config.backoff_cap_s
            )
            attempt += 1
            if failure is not None:
                reach.failed(failure, delay)
            else:
                log.debug("reconnecting in %.1f s", delay)
            await asyncio.sleep(delay)
