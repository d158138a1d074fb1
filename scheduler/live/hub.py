"""The hub of a web process: the Redis client, the watch set and the cluster
ticker that publishes one aggregated round per interval, and the queue-changed
mark the services set after commit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

import redis
import redis.asyncio as aredis
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connections

from scheduler import events, livestate
from scheduler.live.deltas import changed_nodes, diff, is_empty
from scheduler.live.timing import (
    CLAIM_MS,
    REJOIN_S,
    WATCH_REFRESH_S,
    WATCH_TTL_S,
    interval,
    monotonic,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Iterable, Sequence

    from scheduler.events import ClusterDeltaEvent, ClusterState

log = logging.getLogger(__name__)


# Store the new state only if the stored one is still ``expected`` (its seq), so
# two rounds that overlapped never both publish: KEYS[1] state, KEYS[2] seq;
# ARGV[1] expected seq ("0": none yet), ARGV[2] new seq, ARGV[3] the state's JSON.
_COMMIT = """
local seq = redis.call('GET', KEYS[2]) or '0'
if seq ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


def _noop() -> None:
    return None


def build_round(
    raw: bytes | None, readings: dict[bytes, bytes]
) -> tuple[ClusterState | None, ClusterState, ClusterDeltaEvent, str]:
    """A round's work off the event loop: the state from PostgreSQL with the
    nodes' newest readings (``readings``: node id -> the last update's readings,
    newer than what the database holds while it catches up), its delta from the
    stored one (``raw``), and its JSON. Its database connection is closed at the
    end (one round a second on a thread of its own)."""
    try:
        old = cast("ClusterState", json.loads(raw)) if raw else None
        latest = {int(k): json.loads(v) for k, v in readings.items()}
        new = livestate.cluster_state(readings=latest)
        new["seq"] = (old["seq"] if old else 0) + 1
        if old is not None and time.time() - old["at"] > 3 * interval():
            # Nobody published for a while (no browser was connected): send the
            # whole state (base 0), which pages take in place of theirs.
            delta = diff(None, new)
        else:
            delta = diff(old, new)
        return old, new, delta, json.dumps(new)
    finally:
        connections.close_all()


class Member(Protocol):
    """What the hub asks of a browser consumer of its process."""

    async def rejoin(self, *, lost: bool) -> None:
        """Join its groups again (``lost``: Redis lost them; tell the page)."""


class Hub:
    """One per event loop (a web process): the Redis client, the watch set, and
    the cluster ticker (running while this process has browsers connected)."""

    _hubs: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        prefix = f"{settings.REDIS_PREFIX}:live"
        # socket_timeout=None: the ticker's client sits idle between rounds
        # (DESIGN.md, Known pitfalls: redis-py's default timeout).
        self.redis: aredis.Redis = aredis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=None
        )
        self.watch_key = f"{prefix}:watch"
        self.state_key = f"{prefix}:cluster"
        self.seq_key = f"{prefix}:cluster:seq"
        self.gate_key = f"{prefix}:gate"
        self.claim_key = f"{prefix}:claim"
        self.queue_key = f"{prefix}:queue"
        self.readings_key = f"{prefix}:readings"
        self.epoch_key = f"{prefix}:epoch"
        self.clients_key = clients_key()
        # The epoch this hub last saw (None: not read yet).
        self.epoch: bytes | None = None
        self.members: weakref.WeakSet[Member] = weakref.WeakSet()
        self.local: Counter[str] = Counter()
        self._watched: frozenset[str] = frozenset()
        self._watched_at = -1e9
        self._watched_lock = asyncio.Lock()
        self._ticker: asyncio.Task[None] | None = None
        self._commit = self.redis.register_script(_COMMIT)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="live-cluster")
        self.token = f"{id(self):x}-{random.getrandbits(32):08x}"

    @classmethod
    def current(cls) -> Hub:
        loop = asyncio.get_running_loop()
        hub = cls._hubs.get(loop)
        if hub is None:
            hub = cls._hubs[loop] = cls()
        return hub

    # -------------------------------------------------------------- watch set

    async def watch(self, group: str) -> None:
        """A browser of this process subscribed to ``group``."""
        self.local[group] += 1
        await self.redis.zadd(self.watch_key, {group: time.time() + WATCH_TTL_S})
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._run())

    async def unwatch(self, group: str) -> None:
        if self.local[group] <= 1:
            del self.local[group]
        else:
            self.local[group] -= 1
        if not self.local and self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
            with contextlib.suppress(redis.RedisError):  # it expires anyway
                await cast(
                    "Awaitable[int]", self.redis.hdel(self.clients_key, self.token)
                )
            # A round's queries may still run on its thread: let them end (a
            # job queued behind them returns when they did), so nothing of ours
            # touches the database once the last browser left.
            await asyncio.get_running_loop().run_in_executor(self.executor, _noop)

    async def watched(self) -> frozenset[str]:
        """Groups some browser watches (any process), re-read at most once per
        interval."""
        if monotonic() - self._watched_at < interval():
            return self._watched
        async with self._watched_lock:
            if monotonic() - self._watched_at >= interval():
                members = await self.redis.zrangebyscore(
                    self.watch_key, f"({time.time()}", "+inf"
                )
                self._watched = frozenset(m.decode() for m in members)
                self._watched_at = monotonic()
        return self._watched

    def forget_watched(self) -> None:
        """Read the watch set again at the next ``watched()``."""
        self._watched_at = -1e9

    async def refresh(self, groups: Iterable[str]) -> None:
        """Mark ``groups`` (subscribed here already) watched again from now."""
        expiry = time.time() + WATCH_TTL_S
        mapping = dict.fromkeys(groups, expiry)
        if mapping:
            await self.redis.zadd(self.watch_key, mapping)

    # -------------------------------------------------------------- members

    async def report_clients(self) -> None:
        """This process's browser count for /metrics, in a hash every process
        shares (``clients_key``): ``"<count> <expiry>"`` under its token, so a
        process that died drops out after ``WATCH_TTL_S``."""
        value = f"{len(self.members)} {time.time() + WATCH_TTL_S:.3f}"
        await cast(
            "Awaitable[int]", self.redis.hset(self.clients_key, self.token, value)
        )

    def add_member(self, member: Member) -> None:
        """A browser consumer of this process, rejoined by the ticker (weakly
        held: a consumer that crashed without ``remove_member`` drops out)."""
        self.members.add(member)

    def remove_member(self, member: Member) -> None:
        self.members.discard(member)

    async def rejoin_members(self, *, lost: bool) -> None:
        """Every member joins its groups again (concurrently); a failure is
        logged (the next rejoin tries again)."""
        members = list(self.members)
        results = await asyncio.gather(
            *(m.rejoin(lost=lost) for m in members), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning(
                "live: %d of %d dashboards could not rejoin their groups: %r",
                len(failed),
                len(members),
                failed[0],
            )

    async def lost_data(self) -> bool:
        """True if Redis lost its data since the last call (it restarted: the
        epoch key this hub, or another, set is gone or was set again). The first
        call only reads the epoch (setting it if there is none)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.epoch_key, f"{self.token}-{time.time():.6f}", nx=True)
        pipe.get(self.epoch_key)
        _, epoch = await pipe.execute()
        lost = self.epoch is not None and epoch != self.epoch
        self.epoch = epoch
        return lost

    async def recover(self) -> None:
        """Redis lost its data: this process's subscriptions are watched again
        at once, its members rejoin their groups and tell their pages (which
        re-sync as after a reconnect), and the next round, finding no stored
        state, sends the whole state."""
        log.warning(
            "live: Redis lost its data (restarted?): %d dashboards rejoin %d groups",
            len(self.members),
            len(self.local),
        )
        await self.refresh(self.local)
        self.forget_watched()
        await self.rejoin_members(lost=True)

    # -------------------------------------------------------------- cluster

    async def stored_state(self) -> ClusterState | None:
        raw = await self.redis.get(self.state_key)
        return cast("ClusterState", json.loads(raw)) if raw else None

    async def snapshot(self) -> ClusterState | None:
        """The last published state, if it is recent (else None: the page keeps
        what it has until the next delta, then asks again)."""
        state = await self.stored_state()
        if state is None or time.time() - state["at"] > 3 * interval():
            return None
        return state

    async def publish_once(self) -> int:
        """One aggregation round; returns the seq published, 0 if this process did
        not publish (another one claimed the round, the interval is not up, or
        nothing changed), or -1 if the gate was closed (try again later).

        1. Claim the round (``SET NX PX``): only one process builds the state.
        2. Build the state from PostgreSQL and diff it with the stored one.
        3. Pass the gate (``SET NX PX interval``): at most one message per interval,
           by Redis's clock, across every process.
        4. Store the state if the stored seq is still the one diffed against
           (compare-and-set), then send the delta, ``node.state`` for watched
           nodes that changed, and ``queue.changed`` if the queue was marked.
        """
        if not await self.redis.set(self.claim_key, self.token, nx=True, px=CLAIM_MS):
            return 0
        try:
            raw = await self.redis.get(self.state_key)
            readings = await cast(
                "Awaitable[dict[bytes, bytes]]", self.redis.hgetall(self.readings_key)
            )
            # The queries, the diff and the JSON run on a thread of their own:
            # neither this event loop (browsers, agents) nor the thread where
            # the agents' frames are stored waits for them.
            loop = asyncio.get_running_loop()
            old, new, delta, new_json = await loop.run_in_executor(
                self.executor, build_round, raw, readings
            )
            queue = bool(await self.redis.delete(self.queue_key))
            if is_empty(delta) and not queue:
                return 0
            px = max(1, int(interval() * 1000))
            if not await self.redis.set(self.gate_key, "1", nx=True, px=px):
                if queue:  # not lost: the next round sends it
                    await self.redis.set(self.queue_key, "1")
                return -1
            if is_empty(delta):
                seq = old["seq"] if old else 0
            else:
                expected = str(old["seq"]) if old else "0"
                ok = await self._commit(
                    keys=[self.state_key, self.seq_key],
                    args=[expected, new["seq"], new_json],
                )
                if not ok:
                    return 0
                seq = new["seq"]
            await self._send(old, new, delta, queue=queue)
            return seq
        finally:
            # Only our own claim (a slow round's may have expired and been taken).
            if await self.redis.get(self.claim_key) == self.token.encode():
                await self.redis.delete(self.claim_key)

    async def _send(
        self,
        old: ClusterState | None,
        new: ClusterState,
        delta: ClusterDeltaEvent,
        *,
        queue: bool,
    ) -> None:
        layer = get_channel_layer()
        assert layer is not None
        self.forget_watched()
        watched = await self.watched()
        if not is_empty(delta) and events.CLUSTER_GROUP in watched:
            await layer.group_send(events.CLUSTER_GROUP, dict(delta))
        for node in changed_nodes(old, new):
            group = events.node_group(node["id"])
            if group in watched:
                event: events.NodeStateEvent = {
                    "type": "node.state",
                    "node": node,
                    "gpus": [new["gpus"][k] for k in node["gpus"]],
                }
                await layer.group_send(group, dict(event))
        if queue and events.QUEUE_GROUP in watched:
            changed: events.QueueChangedEvent = {
                "type": "queue.changed",
                "at": time.time(),
            }
            await layer.group_send(events.QUEUE_GROUP, dict(changed))

    async def _run(self) -> None:
        """The ticker: a round whenever the gate may be open; refresh this
        process's subscriptions in the watch set; drop expired ones; have the
        members rejoin their groups, at once if Redis lost its data."""
        refreshed = rejoined = monotonic()
        while True:
            try:
                if await self.lost_data():
                    await self.recover()
                    refreshed = rejoined = monotonic()
                if monotonic() - refreshed >= WATCH_REFRESH_S and self.local:
                    await self.refresh(self.local)
                    await self.redis.zremrangebyscore(
                        self.watch_key, "-inf", time.time()
                    )
                    refreshed = monotonic()
                if monotonic() - rejoined >= REJOIN_S:
                    await self.rejoin_members(lost=False)
                    rejoined = monotonic()
                await self.report_clients()
                await self.publish_once()
                ttl = await self.redis.pttl(self.gate_key)
                # Sleep until the gate opens, plus a little jitter so processes
                # do not all race for the same millisecond.
                wait = (ttl / 1000 if ttl > 0 else interval()) + random.uniform(
                    0.005, 0.05
                )
            except asyncio.CancelledError:
                raise
            except Exception:
                # Redis or PostgreSQL away: pages keep their last state; retry.
                log.exception("live: cluster round failed")
                wait = 2 * interval()
            await asyncio.sleep(wait)


# ------------------------------------------------------------------ marks


def clients_key() -> str:
    """The hash of each web process's browser count (``Hub.report_clients``)."""
    return f"{settings.REDIS_PREFIX}:live:clients"


_sync_redis: redis.Redis | None = None


def _sync_client() -> redis.Redis:
    global _sync_redis
    if _sync_redis is None:
        _sync_redis = redis.Redis.from_url(settings.REDIS_URL)
    return _sync_redis


def mark_queue_changed() -> None:
    """Called by services (after commit) when the queue changed; the next round
    tells the pages showing it (at most once per interval)."""
    try:
        _sync_client().set(f"{settings.REDIS_PREFIX}:live:queue", "1")
    except redis.RedisError:
        # Pages notice at their next change or reload; the job's state is stored.
        log.warning("live: could not mark the queue changed", exc_info=True)


def broadcast_job_statuses(statuses: Sequence[tuple[int, str, str]]) -> None:
    """Called by services (after commit) when many jobs changed at once (an
    array's cancel): ``job.status`` (job id, status, message) to the page of
    each job some browser watches, after one read of the watch set, so the cost
    follows the pages open, not the jobs changed (a ``group_send`` costs two
    Redis round trips even to an empty group). A page that subscribes after
    that read loses nothing: it fetches its job again on ``subscribed``. With
    Redis unreadable (the channel layer's too) nothing is sent and one warning
    logged: the pages show the stored states at their next change or reload."""
    if not statuses:
        return
    try:
        members = _sync_client().zrangebyscore(
            f"{settings.REDIS_PREFIX}:live:watch", f"({time.time()}", "+inf"
        )
    except redis.RedisError:
        log.warning(
            "live: could not read the watch set; %d job.status not sent",
            len(statuses),
            exc_info=True,
        )
        return
    watched = {m.decode() for m in cast("list[bytes]", members)}
    events.broadcast_job_statuses(
        [item for item in statuses if events.job_group(item[0]) in watched]
    )
