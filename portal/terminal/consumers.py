"""The terminal of an interactive job over ``/ws/interactive/<job_id>/terminal/``.

One websocket is one viewer of one terminal (a PTY on the job's node, started
by its agent: ``agents.terminal``). The relay:

- browser -> agent: the viewer's messages become ``terminal.*`` frames sent to
  the node's agent through the channel layer (``agent.terminal`` events, which
  ``scheduler.consumers.AgentConsumer`` forwards on the agent's websocket);
- agent -> browser: the agent's ``terminal.output`` / ``terminal.exit`` frames
  are sent by ``AgentConsumer`` to the terminal's group
  (``events.terminal_group``), which this consumer joined.

Who: the job's owner (a browser session, or ``Authorization: Bearer <API token>``
for ``gpulab shell``); anyone else only with the
``scheduler.open_any_interactive`` permission (staff), each opening recorded as
a job event. Anyone else, an unknown job, or no sign-in: the socket is closed
with ``CLOSE_NOT_FOUND`` before any data (the same for a job that does not
exist, so nothing is learnt). The job must be an interactive job that runs.

The messages (JSON text frames):

- first, from the viewer: ``{"type": "open", "cols": N, "rows": N}`` with
  ``"terminal": ID`` to attach again to a terminal it had (its scrollback is
  replayed), or ``"command": "..."`` to run one command; answered with
  ``{"type": "opened", "terminal": ID}``;
- then ``{"type": "input", "data": "..."}``, ``{"type": "resize", "cols": N,
  "rows": N}``, ``{"type": "close"}`` (hang the terminal up);
- to the viewer: ``{"type": "output", "data": "...", "replay": bool}``,
  ``{"type": "exit", "code": N | null, "message": "..."}`` (then the socket
  closes), ``{"type": "error", "message": "..."}`` for a bad message.

Closing the socket without ``close`` detaches: the PTY lingers on the node (the
agent's ``--terminal-linger``), so a web process restart loses nothing the
viewer cannot get back by opening the same terminal id.

Flow control: output is bounded on the node (``agents.terminal.PENDING_MAX``)
and in the channel layer (``GPULAB_CHANNEL_CAPACITY`` per viewer); what a full
channel drops shows up as a gap in the frames' count, and the viewer gets a
marker line saying output was skipped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from redis.exceptions import RedisError

from agents import protocol
from portal.api.auth import user_for_token
from portal.directory.identity import user_group
from portal.idle import activity
from scheduler import events
from scheduler.models import Attempt, Job, JobEvent
from scheduler.throttle import TokenBucket
from scheduler.ws import PeerGoneSafe

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from django.contrib.auth.models import AnonymousUser, User

log = logging.getLogger(__name__)

# Not signed in, not the owner, no such job: one code, like the pages' 404.
CLOSE_NOT_FOUND = 4404
# The job is not an interactive job that runs now (the owner is told why).
CLOSE_NOT_RUNNING = 4409
# The first message was not a valid "open".
CLOSE_BAD_OPEN = 4400
# The viewer's account was deactivated (as the live pages' sockets).
CLOSE_SIGNED_OUT = 4401
# Most characters one viewer message may hold (a paste).
MAX_MESSAGE_CHARS = protocol.MAX_TERMINAL_CHARS
# The permission that lets staff open another user's interactive job.
ACCESS_PERMISSION = "scheduler.open_any_interactive"
# An open not answered (no output, no exit) within this is sent again: the
# node's agent may be reconnecting (the web process it was on restarting).
OPEN_RETRY_S = 1.0
OPEN_TRIES = 30
# What one viewer may send: messages a second (a burst of BURST_S seconds' worth)
# and characters a second. Past it, messages are dropped with an error, so that
# a flood cannot fill the node's agent channel (its launches and kills go there).
# Input typed before the agent answered the open waits here (it would reach an
# agent that does not know the terminal yet), up to this many characters.
MAX_HELD_CHARS = 64 * 1024
MAX_MESSAGES_PER_S = 200.0
MAX_CHARS_PER_S = 256 * 1024.0
BURST_S = 2.0
SKIPPED = "\r\n[gpulab: output skipped: the connection could not keep up]\r\n"


@dataclass(frozen=True)
class Target:
    """Where the job's terminals run: its live attempt and its (rank 0) node."""

    job_id: int
    attempt_id: int
    node_id: int
    # The viewer's account: its group closes the socket when it is deactivated.
    user_id: int


def new_terminal_id(attempt_id: int) -> str:
    """A random id, signed for the attempt: only a viewer of that attempt's job
    can attach to it again (``terminal_id_is_for``), whoever learns an id."""
    nonce = secrets.token_urlsafe(18)
    return f"{nonce}-{_signature(attempt_id, nonce)}"


def terminal_id_is_for(terminal_id: str, attempt_id: int) -> bool:
    nonce, _, signature = terminal_id.rpartition("-")
    return bool(nonce) and hmac.compare_digest(signature, _signature(attempt_id, nonce))


def _signature(attempt_id: int, nonce: str) -> str:
    digest = hmac.new(
        settings.SECRET_KEY.encode(),
        f"gpulab.terminal:{attempt_id}:{nonce}".encode(),
        hashlib.sha256,
    ).digest()[:16]
    return base64.urlsafe_b64encode(digest).decode().rstrip("=").replace("-", "_")


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() in ("bearer", "token") and token.strip():
                return token.strip()
    return None


def _user(scope: Mapping[str, Any]) -> User | AnonymousUser | None:
    """The token's user when the handshake carries one, else the session's."""
    token = _bearer(scope.get("headers", []))
    if token is not None:
        found = user_for_token(token)
        return None if found is None else found[0]
    user: User | AnonymousUser | None = scope.get("user")
    return user


def _target(
    scope: Mapping[str, Any], job_id: int
) -> tuple[Target | None, str | None, bool]:
    """(target, why not, visible): ``visible`` False means close as not found."""
    user = _user(scope)
    if user is None or not user.is_authenticated:
        return None, None, False
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return None, None, False
    if job.owner_id != user.pk and not user.has_perm(ACCESS_PERMISSION):
        return None, None, False
    if not job.interactive:
        return None, f"job {job_id} is not an interactive job", True
    if job.status != Job.Status.RUNNING:
        return None, f"job {job_id} is {job.status}, not running", True
    attempt = (
        Attempt.objects.filter(job_id=job_id, ended_at__isnull=True)
        .values("pk", "node_id")
        .first()
    )
    if attempt is None:
        return None, f"job {job_id} has no running attempt", True
    if job.owner_id != user.pk:
        JobEvent.objects.create(
            job=job,
            source=JobEvent.Source.USER,
            actor=user,
            message=f"terminal opened by {user.get_username()} (staff)",
        )
    return Target(job_id, attempt["pk"], attempt["node_id"], user.pk), None, True


class TerminalConsumer(PeerGoneSafe, AsyncWebsocketConsumer):
    """One viewer of one terminal of a running interactive job."""

    target: Target | None = None
    terminal_id: str | None = None
    group: str | None = None
    last_n: int | None = None
    ended: bool = False
    viewer: str = ""
    answered: bool = False
    retry: asyncio.Task[None] | None = None
    messages: TokenBucket | None = None
    chars: TokenBucket | None = None
    refused: int = 0
    held: list[str]

    @staticmethod
    def _now() -> float:
        """The input allowance's clock."""
        return time.monotonic()

    async def connect(self) -> None:
        job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        target, why, visible = await database_sync_to_async(_target)(self.scope, job_id)
        await self.accept()
        if not visible:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        if target is None:
            await self._send({"type": "exit", "code": None, "message": why or ""})
            await self.close(code=CLOSE_NOT_RUNNING)
            return
        self.target = target
        # Deactivated (directory, identity provider): the socket closes at once.
        await self.channel_layer.group_add(
            user_group(target.user_id), self.channel_name
        )
        self.messages = TokenBucket(MAX_MESSAGES_PER_S, BURST_S, clock=self._now)
        self.chars = TokenBucket(MAX_CHARS_PER_S, BURST_S, clock=self._now)

    async def disconnect(self, code: int) -> None:
        if self.retry is not None:
            self.retry.cancel()
        if self.target is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.channel_layer.group_discard(
                    user_group(self.target.user_id), self.channel_name
                )
        if self.group is not None:
            try:
                await self.channel_layer.group_discard(self.group, self.channel_name)
                if not self.ended and self.terminal_id is not None:
                    await self._to_agent(
                        protocol.TerminalClose,
                        protocol.TerminalCloseData(
                            terminal_id=self.terminal_id,
                            detach=True,
                            viewer=self.viewer,
                        ),
                    )
            except (RedisError, OSError) as exc:
                log.warning("terminal %s: detach not sent: %r", self.terminal_id, exc)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None
    ) -> None:
        if self.target is None or self.ended:
            return
        raw = text_data if text_data is not None else (bytes_data or b"").decode()
        if len(raw) > MAX_MESSAGE_CHARS + 256:
            await self._error(f"message of {len(raw)} characters is too long")
            return
        assert self.messages is not None and self.chars is not None
        if not (self.messages.take() and self.chars.take(len(raw))):
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                await self._error(
                    f"over {MAX_MESSAGES_PER_S:g} messages or"
                    f" {int(MAX_CHARS_PER_S)} characters a second: input dropped"
                )
            return
        try:
            message = json.loads(raw)
            kind = message["type"]
        except (ValueError, TypeError, KeyError):
            await self._error('expected a JSON object with a "type"')
            return
        try:
            if self.terminal_id is None:
                if kind != "open":
                    await self._error('the first message must be {"type": "open"}')
                    await self.close(code=CLOSE_BAD_OPEN)
                    return
                await self._open(message)
            elif kind == "input":
                data = protocol.TerminalInputData(
                    terminal_id=self.terminal_id, data=message["data"]
                )
                # A keystroke is a person's use: the idle culling counts it.
                await activity.atouch(self.target.job_id)
                if self.answered:
                    await self._to_agent(protocol.TerminalInput, data)
                elif sum(map(len, self.held)) + len(data.data) <= MAX_HELD_CHARS:
                    self.held.append(data.data)
                else:
                    await self._error("input dropped: the terminal is not open yet")
            elif kind == "resize":
                await self._to_agent(
                    protocol.TerminalResize,
                    protocol.TerminalResizeData(
                        terminal_id=self.terminal_id,
                        cols=message["cols"],
                        rows=message["rows"],
                    ),
                )
            elif kind == "close":
                await self._to_agent(
                    protocol.TerminalClose,
                    protocol.TerminalCloseData(terminal_id=self.terminal_id),
                )
            else:
                await self._error(f"unknown message type {kind!r}")
        except (KeyError, ValueError, TypeError) as exc:
            # pydantic's ValidationError is a ValueError: it names the field.
            await self._error(f"bad {kind!r} message: {exc}")

    async def _open(self, message: dict[str, Any]) -> None:
        assert self.target is not None
        terminal_id = message.get("terminal")
        if terminal_id is None:
            terminal_id = new_terminal_id(self.target.attempt_id)
        elif not isinstance(terminal_id, str) or not terminal_id_is_for(
            terminal_id, self.target.attempt_id
        ):
            await self._send(
                {
                    "type": "exit",
                    "code": None,
                    "message": "no such terminal in this job",
                }
            )
            await self.close(code=CLOSE_NOT_RUNNING)
            return
        self.viewer = secrets.token_urlsafe(12)
        self.held = []
        data = protocol.TerminalOpenData(
            terminal_id=terminal_id,
            attempt_id=self.target.attempt_id,
            job_id=self.target.job_id,
            cols=message.get("cols", 80),
            rows=message.get("rows", 24),
            viewer=self.viewer,
            command=message.get("command"),
        )
        self.terminal_id = terminal_id
        self.group = events.terminal_group(terminal_id)
        # Joined before the open goes out: the first output must find us.
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self._send({"type": "opened", "terminal": terminal_id})
        await self._to_agent(protocol.TerminalOpen, data)
        self.retry = asyncio.create_task(self._open_again(data))

    async def _open_again(self, data: protocol.TerminalOpenData) -> None:
        """Send the open again until the agent answers (its first output or the
        terminal's end): a viewer attaching while the node's agent reconnects
        (after a web process restart) must not wait on a lost frame. The agent
        attaches one viewer once, whatever the repeats."""
        for _ in range(OPEN_TRIES):
            await asyncio.sleep(OPEN_RETRY_S)
            if self.answered or self.ended:
                return
            with contextlib.suppress(RedisError, OSError):
                await self._to_agent(protocol.TerminalOpen, data)
        if not self.answered:
            await self.terminal_exit(
                {
                    "code": None,
                    "message": "the job's node does not answer; try again later",
                }
            )

    async def _to_agent(self, model: type[protocol._Envelope], data: Any) -> None:
        assert self.target is not None
        event: events.AgentTerminalEvent = {
            "type": "agent.terminal",
            "frame": events.frame(model, data),
        }
        await self.channel_layer.group_send(
            events.agent_group(self.target.node_id), dict(event)
        )

    # ------------------------------------------------------------ from the agent

    async def _answered(self) -> None:
        """The agent knows the terminal now: the input typed meanwhile goes."""
        if self.answered:
            return
        self.answered = True
        held, self.held = self.held, []
        if self.terminal_id is not None:
            for text in held:
                await self._to_agent(
                    protocol.TerminalInput,
                    protocol.TerminalInputData(terminal_id=self.terminal_id, data=text),
                )

    async def user_signed_out(self, event: dict[str, Any]) -> None:
        """The viewer's account was deactivated: signed out (4401), as its live
        pages are; the shell stays the job's until the job ends."""
        await self.close(code=CLOSE_SIGNED_OUT)

    async def terminal_output(self, event: dict[str, Any]) -> None:
        await self._answered()
        n = int(event.get("n", 0))
        data = event["data"]
        if event.get("replay"):
            self.last_n = None
        if self.last_n is not None and n > self.last_n + 1:
            data = SKIPPED + data
        self.last_n = n
        await self._send(
            {"type": "output", "data": data, "replay": bool(event.get("replay"))}
        )

    async def terminal_exit(self, event: dict[str, Any]) -> None:
        self.answered = True
        self.ended = True
        await self._send(
            {"type": "exit", "code": event["code"], "message": event["message"]}
        )
        await self.close(code=1000)

    async def _send(self, message: dict[str, Any]) -> None:
        await self.send(text_data=json.dumps(message))

    async def _error(self, message: str) -> None:
        await self._send({"type": "error", "message": message[:1000]})
