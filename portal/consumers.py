"""Browser dashboards over ``/ws/dashboard/`` (session auth, Origin checked).

The protocol, JSON both ways (docs/architecture.md, "Live dashboards"):

- ``{"subscribe": "cluster"}``, ``{"subscribe": "queue"}``,
  ``{"subscribe": "node", "id": N}``, ``{"subscribe": "job", "id": N}``;
  ``{"unsubscribe": ...}`` the same way; ``{"resync": "cluster"}`` asks for the
  whole cluster state again (a browser that missed a delta).
- Replies: ``{"subscribed": "<group>"}`` (then, for ``cluster``, the whole state if
  a recent one exists), ``{"unsubscribed": "<group>"}``, or ``{"error": "..."}``
  naming what was wrong. Updates: the ``scheduler.events`` dashboard events, as
  sent to the groups.

Who sees what: every signed-in user sees the cluster, the queue and every node
(job numbers, names and owners included, as on the pages); a job's own group
(its output, its state, its GPUs) only its owner and staff, as its page.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from redis.exceptions import RedisError

from portal.directory.identity import user_group
from scheduler import events, live
from scheduler.models import Job, Node
from scheduler.throttle import TokenBucket
from scheduler.ws import PeerGoneSafe

log = logging.getLogger(__name__)

# Bounds on what one browser tab may ask (a page needs two or three groups).
MAX_GROUPS = 32
MAX_MESSAGE_CHARS = 1024
# Messages from the browser: a bucket of BURST, refilled at RATE a second; past
# it, messages are refused with an error, and after MAX_REFUSED refusals the
# connection is closed (4429).
RATE = 5.0
BURST = 20.0
MAX_REFUSED = 50

CLOSE_UNAUTHENTICATED = 4401
CLOSE_TOO_MANY = 4429

USAGE = (
    'expected {"subscribe": "cluster" | "queue"} or '
    '{"subscribe": "node" | "job", "id": N} (or "unsubscribe" the same way, '
    'or {"resync": "cluster"})'
)


class DashboardConsumer(PeerGoneSafe, AsyncJsonWebsocketConsumer):
    """Live updates for one browser tab.

    ``connect`` needs a signed-in session (else close 4401); the ASGI router has
    already checked the Origin. Each subscription is checked once (the group's
    object must exist and be visible to the user), then joins the Channels group
    and marks it watched (``live.Hub``), so updates flow only while someone looks.
    A malformed, unknown or refused message gets ``{"error": ...}`` and the
    connection stays usable; a flood is refused and finally closed.

    It is a member of its process's ``live.Hub``, whose ticker has it join its
    groups again every ``live.REJOIN_S`` (``rejoin``): a Redis restart loses
    the memberships while the websocket stays open.
    """

    groups_joined: set[str]
    own_group: str
    messages: TokenBucket
    refused: int

    @staticmethod
    def _now() -> float:
        """The message allowance's clock."""
        return live.monotonic()

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.groups_joined = set()
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.messages = TokenBucket(RATE, BURST / RATE, clock=self._now)
        self.refused = 0
        # Closed when the directory removes the user (portal.directory).
        self.own_group = user_group(user.pk)
        await self.channel_layer.group_add(self.own_group, self.channel_name)
        await self.accept()
        live.Hub.current().add_member(self)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # However it ended: a consumer that crashed (its channel's receive
            # failed while Redis was away) never ran ``disconnect``, and must
            # neither stay a member of the hub (which would add its dead channel
            # to its groups again) nor keep its groups watched.
            await self._leave_all()

    async def disconnect(self, code: int) -> None:
        await self._leave_all()

    async def _leave_all(self) -> None:
        hub = live.Hub.current()
        hub.remove_member(self)
        groups: set[str] = getattr(self, "groups_joined", set())
        self.groups_joined = set()
        if getattr(self, "own_group", None):
            with contextlib.suppress(RedisError, OSError):
                await self.channel_layer.group_discard(
                    self.own_group, self.channel_name
                )
        for group in groups:
            await hub.unwatch(group)
            try:
                await self.channel_layer.group_discard(group, self.channel_name)
            except (RedisError, OSError) as exc:
                # Redis is away (and when it comes back the group is gone).
                log.info("dashboard: could not leave %s: %r", group, exc)

    # -------------------------------------------------------------- from the tab

    async def receive(
        self,
        text_data: str | None = None,
        bytes_data: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.messages.take():
            self.refused += 1
            if self.refused > MAX_REFUSED:
                await self.close(code=CLOSE_TOO_MANY)
                return
            await self._error(f"too many messages: at most {RATE:g} a second")
            return
        if text_data is None:
            await self._error("expected a JSON text message")
            return
        if len(text_data) > MAX_MESSAGE_CHARS:
            await self._error(f"message too long (over {MAX_MESSAGE_CHARS} chars)")
            return
        try:
            content = json.loads(text_data)
        except ValueError:
            await self._error("not JSON: " + USAGE)
            return
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict):
            await self._error(USAGE)
            return
        if set(content) == {"resync"} and content["resync"] == events.CLUSTER_GROUP:
            await self._resync()
            return
        verb = next((v for v in ("subscribe", "unsubscribe") if v in content), None)
        if verb is None or not set(content) <= {verb, "id"}:
            await self._error(USAGE)
            return
        kind, object_id = content[verb], content.get("id")
        valid_id = object_id is None or (
            isinstance(object_id, int)
            and not isinstance(object_id, bool)
            and 0 < object_id < 2**63
        )
        group = (
            events.dashboard_group(kind, object_id)
            if isinstance(kind, str) and valid_id
            else None
        )
        if group is None:
            await self._error(f"unknown group {json.dumps(content)[:200]}: {USAGE}")
            return
        if verb == "unsubscribe":
            await self._leave(group)
            return
        if group in self.groups_joined:
            await self.send_json({"subscribed": group})
            return
        if len(self.groups_joined) >= MAX_GROUPS:
            await self._error(f"too many subscriptions (at most {MAX_GROUPS})")
            return
        if kind == "job" and not await self._may_see_job(object_id or 0):
            await self._error("no such job")
            return
        if kind == "node" and not await self._node_exists(object_id or 0):
            await self._error("no such node")
            return
        await self._join(group)

    async def _join(self, group: str) -> None:
        hub = live.Hub.current()
        await self.channel_layer.group_add(group, self.channel_name)
        self.groups_joined.add(group)
        await hub.watch(group)
        # This process's agents start sending to it at once (others within a
        # second, when they re-read the watch set).
        hub.forget_watched()
        await self.send_json({"subscribed": group})
        if group == events.CLUSTER_GROUP:
            state = await hub.snapshot()
            if state is not None:
                await self.send_json({"type": "cluster.state", "state": state})

    async def _leave(self, group: str) -> None:
        if group in self.groups_joined:
            self.groups_joined.discard(group)
            await self.channel_layer.group_discard(group, self.channel_name)
            await live.Hub.current().unwatch(group)
        await self.send_json({"unsubscribed": group})

    async def rejoin(self, *, lost: bool) -> None:
        """Join this tab's groups again (``live.Hub``'s ticker calls it every
        ``live.REJOIN_S``; the hub itself keeps the process's groups watched).
        ``lost``: Redis lost its data, so the page missed what was sent
        meanwhile: each group is acknowledged again (``subscribed``), on which
        pages re-sync as after a reconnect."""
        await self.channel_layer.group_add(self.own_group, self.channel_name)
        for group in sorted(self.groups_joined):
            await self.channel_layer.group_add(group, self.channel_name)
            if group not in self.groups_joined:
                # Left while we were adding it back: leave it again.
                await self.channel_layer.group_discard(group, self.channel_name)
                continue
            if lost:
                await self.send_json({"subscribed": group})

    async def _resync(self) -> None:
        if events.CLUSTER_GROUP not in self.groups_joined:
            await self._error('subscribe to "cluster" first')
            return
        state = await live.Hub.current().stored_state()
        if state is not None:
            await self.send_json({"type": "cluster.state", "state": state})

    async def _error(self, message: str) -> None:
        await self.send_json({"error": message})

    @database_sync_to_async
    def _may_see_job(self, job_id: int) -> bool:
        user = self.scope["user"]
        return Job.objects.visible_to(user).filter(pk=job_id).exists()  # type: ignore[arg-type]

    @database_sync_to_async
    def _node_exists(self, node_id: int) -> bool:
        return Node.objects.filter(pk=node_id).exists()

    # -------------------------------------------------------------- to the tab

    async def user_signed_out(self, event: dict[str, Any]) -> None:
        """The user's account was deactivated: the tab is signed out (4401)."""
        await self.close(code=CLOSE_UNAUTHENTICATED)

    async def _forward(self, event: dict[str, Any]) -> None:
        await self.send_json({k: v for k, v in event.items() if not k.startswith("_")})

    async def job_status(self, event: dict[str, Any]) -> None:
        await self._forward(event)

    async def job_metrics(self, event: dict[str, Any]) -> None:
        await self._forward(event)

    async def job_log(self, event: dict[str, Any]) -> None:
        await self._forward(event)

    async def job_progress(self, event: dict[str, Any]) -> None:
        await self._forward(event)

    async def node_metrics(self, event: dict[str, Any]) -> None:
        await self._forward(event)

    async def node_state(self, event: dict[str, Any]) -> None:
        await self._forward(event)

    async def cluster_delta(self, event: dict[str, Any]) -> None:
        await self._forward(event)

    async def queue_changed(self, event: dict[str, Any]) -> None:
        await self._forward(event)
