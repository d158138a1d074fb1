"""What a test's code really sent through Redis: Channels group messages and
Celery tasks, read back from the real channel layer and broker.

Nothing on the send path is replaced. ``Channels`` joins a channel of its own to
the groups a test watches (``join``; ``AgentFrames`` joins ``agent.<id>`` of every
node the test has or creates) on the configured channels_redis layer, so each
``group_send`` the product makes stores a copy for it in Redis; the copies are read
back without blocking (the layer keeps a channel's messages in a sorted set scored
by send time, at ``layer.prefix + channel``). ``Broker`` reads the messages that
``delay`` published to this run's Celery queue (a Redis list under the run's key
prefix). Both read what is there when asked: on-commit sends are there once the
transaction's callbacks ran (``django_capture_on_commit_callbacks(execute=True)``
or a transactional test's commit).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, cast

import redis
from asgiref.sync import async_to_sync
from celery import current_app
from channels.layers import get_channel_layer
from django.conf import settings
from django.db.models.signals import post_save

from scheduler import events

PASS_TASK = "scheduler.tasks.schedule_pass"


class Channels:
    """A listener on the real channel layer: one channel of its own per group it
    joined, whose messages (as stored in Redis) it reads back in send order."""

    def __init__(self) -> None:
        # channels_redis's RedisChannelLayer (untyped)
        self.layer: Any = get_channel_layer()
        self.redis = redis.Redis.from_url(settings.REDIS_URL)
        self._token = uuid.uuid4().hex[:12]
        self._channels: dict[str, str] = {}  # group -> our channel in it

    def join(self, *groups: str) -> None:
        """Listen to ``groups`` from now on (a group joined twice is one listener)."""
        new = [g for g in groups if g not in self._channels]
        for group in new:
            self._channels[group] = f"capture-{self._token}.{group}"
        if new:
            pairs = [(g, self._channels[g]) for g in new]

            async def add() -> None:
                for group, channel in pairs:
                    await self.layer.group_add(group, channel)

            async_to_sync(add)()

    def _key(self, group: str) -> str:
        if group not in self._channels:
            raise AssertionError(f"not listening to {group!r}: join it first")
        return f"{self.layer.prefix}{self._channels[group]}"

    def _stored(self, group: str) -> list[tuple[float, dict[str, Any]]]:
        rows = cast(
            "list[tuple[bytes, float]]",
            self.redis.zrange(self._key(group), 0, -1, withscores=True),
        )
        out = []
        for raw, score in rows:
            message = self.layer.deserialize(raw)
            message.pop("__asgi_channel__", None)  # the layer's routing, as receive
            out.append((score, message))
        return out

    def messages(self, group: str) -> list[dict[str, Any]]:
        """Every message sent to ``group`` since it was joined (or cleared)."""
        return [message for _, message in self._stored(group)]

    def groups(self) -> list[str]:
        return list(self._channels)

    def clear(self) -> None:
        """Forget what was received so far (the groups stay joined)."""
        keys = [self._key(g) for g in self._channels]
        if keys:
            self.redis.delete(*keys)

    def close(self) -> None:
        pairs = list(self._channels.items())

        async def discard() -> None:
            for group, channel in pairs:
                await self.layer.group_discard(group, channel)

        if pairs:
            async_to_sync(discard)()
        self.clear()
        self._channels.clear()
        self.redis.close()


class AgentFrames:
    """The frames the portal sent to node agents (``events.send_to_agent``) as they
    went through Redis: it listens to ``agent.<id>`` of every node that exists when
    it starts and of every node created after."""

    def __init__(self, channels: Channels) -> None:
        from scheduler.models import Node

        self.channels = channels
        self._nodes: list[int] = []
        self.watch(*Node.objects.values_list("pk", flat=True))
        post_save.connect(self._node_saved, sender=Node, weak=False)

    def _node_saved(
        self, sender: Any, *, instance: Any, created: bool, **kw: Any
    ) -> None:
        if created:
            self.watch(instance.pk)

    def watch(self, *node_ids: int) -> None:
        fresh = [n for n in node_ids if n not in self._nodes]
        self._nodes.extend(fresh)
        self.channels.join(*(events.agent_group(n) for n in fresh))

    def _events(self, kind: str) -> list[tuple[float, int, dict[str, Any]]]:
        out = []
        for node_id in self._nodes:
            for score, message in self.channels._stored(events.agent_group(node_id)):
                if message["type"] == kind:
                    out.append((score, node_id, message))
        out.sort(key=lambda row: row[0])
        return out

    def calls(self) -> list[tuple[int, dict[str, Any]]]:
        """(node id, frame) of every command frame sent, in send order."""
        return [(n, m["frame"]) for _, n, m in self._events("agent.command")]

    def frames(self, node_id: int | None = None) -> list[dict[str, Any]]:
        """The frames sent (to one node's agent if ``node_id``), in send order."""
        return [f for n, f in self.calls() if node_id is None or n == node_id]

    def of_type(self, frame_type: str) -> list[tuple[int, dict[str, Any]]]:
        """(node id, frame) of the frames of one type (``"job.kill"``)."""
        return [(n, f) for n, f in self.calls() if f["type"] == frame_type]

    def count(self) -> int:
        return len(self.calls())

    def only(self) -> tuple[int, dict[str, Any]]:
        """The one frame sent (node id, frame); fails unless exactly one was."""
        calls = self.calls()
        assert len(calls) == 1, f"expected one frame, got {len(calls)}: {calls}"
        return calls[0]

    def revocations(self) -> list[tuple[int, str]]:
        """(node id, new token hash) of each ``agent.revoked`` sent."""
        return [(n, m["token_hash"]) for _, n, m in self._events("agent.revoked")]

    def clear(self) -> None:
        self.channels.clear()

    def close(self) -> None:
        from scheduler.models import Node

        post_save.disconnect(self._node_saved, sender=Node)


class Broker:
    """The tasks published to this run's Celery queue on the real broker."""

    def __init__(self) -> None:
        conf = current_app.conf
        prefix = conf.broker_transport_options.get("global_keyprefix", "")
        self.key = f"{prefix}{conf.task_default_queue}"
        self.redis = redis.Redis.from_url(settings.REDIS_URL)

    def tasks(self) -> list[str]:
        """The names of the tasks queued, oldest first."""
        raw = cast("list[bytes]", self.redis.lrange(self.key, 0, -1))
        return [json.loads(m)["headers"]["task"] for m in reversed(raw)]

    def passes(self) -> int:
        """How many scheduling passes are queued."""
        return self.tasks().count(PASS_TASK)

    def purge(self) -> None:
        self.redis.delete(self.key)

    def close(self) -> None:
        self.redis.close()
