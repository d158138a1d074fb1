"""Live dashboards: who sends what to the browsers' groups, and how often.

Three paths, each bounded whatever the cluster's size (docs/architecture.md,
"Live dashboards"):

1. **Node and job updates** (``NodeFeed``, one per agent connection, in the web
   process the agent is connected to): each metrics frame is offered to a
   per-node ``Throttle``: at most one update per second (``GPULAB_LIVE_INTERVAL``)
   of the node's samples, never two within half a second. It goes to
   ``node.<id>`` and to ``job.<id>`` of each job on the node's GPUs, each only while
   some browser watches that group: nobody watching costs no Channels traffic.
2. **The cluster** (``Hub.publish_once``): one aggregated message a second for the
   whole cluster, whatever its size and however many web processes run. Every web
   process with browsers connected runs the ticker; a Redis key set with ``NX PX``
   (``live:claim``) picks the one that builds the state this round (four queries,
   ``scheduler.livestate``), a second one (``live:gate``, ``PX`` = the interval,
   Redis's clock) lets a message out at most once per interval, and a compare-and-set
   on the stored state's ``seq`` keeps two rounds from both publishing. Readings
   come from the node feeds (a Redis hash each feed writes with its updates while
   the cluster is watched), structure and holders from PostgreSQL. The message
   is a delta from the previous state (stored in Redis, so the next round may run in
   another process); a browser that missed one asks for the whole state.
   The same round sends ``node.state`` to watched node groups whose status or
   holders changed, and ``queue.changed`` when services marked the queue changed.
3. **Job state and output**: services broadcast ``job.status`` on commit (as
   before, and mark the queue changed); the agent consumer sends stored log chunks
   to a watched ``job.<id>``.

Which groups are watched: each browser subscription adds its group to a Redis
sorted set (score = expiry, refreshed every ``WATCH_REFRESH_S``); each process reads
the set at most once per interval and keeps it in memory.

When Redis restarts (it keeps no data on disk), the browsers' group memberships,
the watch set and the stored cluster state are gone while their websockets stay
open. The hub's ticker has its members (the browser consumers of this process)
join their groups again every ``REJOIN_S``, and notices the loss itself at once:
an epoch key it sets (``NX``) and reads back each round is gone or another one.
Then it marks its groups watched again and has its members rejoin and say
``subscribed`` again, so the pages re-sync as after a reconnect; the next round
finds no stored state and sends the whole state (``base`` 0).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import redis
import redis.asyncio as aredis
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connections

from scheduler import events, livestate
from scheduler.models import Allocation

if TYPE_CHECKING:
    from collections.abc import Awaitable, Iterable

    from agents import protocol
    from scheduler.events import (
        ClusterDeltaEvent,
        ClusterState,
        GpuLive,
        GpuSampleLive,
        JobGpuLive,
        NodeLive,
    )

log = logging.getLogger(__name__)

# A subscription stays in the watch set this long without a refresh (a web process
# that died leaves its groups watched at most this long).
WATCH_TTL_S = 60.0
WATCH_REFRESH_S = 20.0
# The agent consumer's cache of which attempts hold its node's GPUs is reloaded
# when a launch, kill, start or exit passes through it, and at least this often.
HOLDERS_MAX_AGE_S = 30.0
# A metrics frame older than this (replayed from the agent's spool after a
# reconnect) is stored but not shown as live.
LIVE_MAX_AGE_S = 10.0
# Whoever claims a round has this long to publish it before another may.
CLAIM_MS = 2000
# The nodes' last readings kept for the aggregator vanish when no node sent any
# for this long (then the database's latest state is all there is).
READINGS_TTL_S = 60
# The hub's members (browser consumers) join their groups again this often: a
# membership is gone when Redis restarted, and lapses after channels_redis's
# group expiry (a day) on a tab left open.
REJOIN_S = 10.0


def interval() -> float:
    return float(settings.GPULAB_LIVE_INTERVAL)


def monotonic() -> float:
    return time.monotonic()


# ------------------------------------------------------------------ throttle


class Throttle:
    """How often one node's updates go out: at most one per ``period`` of the
    node's own samples, and never two within half a period of each other.

    ``decide(sampled_at, now)`` returns None (drop it: its slot of sample time
    already went out), 0 (send it now) or the seconds to hold it (a frame of a new
    slot that came too soon after the last send; the caller keeps the latest).
    Slots are counted on the sample clock, not on arrival: an agent sampling once
    a second gets each sample out as it arrives, and a late one never makes the
    next ones late too (a period counted from the last send would hold every
    frame after one slow one: the first bench run saw seconds of lag pile up so).
    """

    # A sample clock that went back this many periods is a reset clock, not a
    # replay: start counting again.
    CLOCK_RESET = 60

    def __init__(self, period: float) -> None:
        self.period = period
        self.last_slot: int | None = None
        self.last_sent: float | None = None

    def decide(self, sampled_at: float, now: float) -> float | None:
        slot = math.floor(sampled_at / self.period)
        last = self.last_slot
        if last is not None and last - self.CLOCK_RESET < slot <= last:
            return None
        if self.last_sent is not None and now - self.last_sent < self.period / 2:
            return self.last_sent + self.period / 2 - now
        return 0.0

    def sent(self, sampled_at: float, now: float) -> None:
        self.last_slot = math.floor(sampled_at / self.period)
        self.last_sent = now


# ------------------------------------------------------------------ deltas


def _structure(gpu: GpuLive) -> tuple[Any, ...]:
    """What a node page redraws its grid for (not the readings)."""
    return (
        gpu["state"],
        gpu["reason"],
        tuple((j["id"], j["name"], j["owner"]) for j in gpu["jobs"]),
        tuple(f["pid"] for f in gpu["foreign"]),
    )


def _without_at(gpu: GpuLive) -> dict[str, Any]:
    return {k: v for k, v in gpu.items() if k != "at"}


def diff(old: ClusterState | None, new: ClusterState) -> ClusterDeltaEvent:
    """The delta from ``old`` to ``new`` (``old`` None: everything is new). A GPU
    whose only change is the time of its reading is left out."""
    old_nodes = {n["id"]: n for n in old["nodes"]} if old else {}
    old_gpus = old["gpus"] if old else {}
    new_nodes = {n["id"]: n for n in new["nodes"]}
    order = [n["id"] for n in new["nodes"]]
    old_order = [n["id"] for n in old["nodes"]] if old else None
    return {
        "type": "cluster.delta",
        "seq": new["seq"],
        "base": old["seq"] if old else 0,
        "at": new["at"],
        "nodes": [n for i, n in new_nodes.items() if old_nodes.get(i) != n],
        "gpus": [
            g
            for k, g in new["gpus"].items()
            if k not in old_gpus or _without_at(old_gpus[k]) != _without_at(g)
        ],
        "removed_nodes": [i for i in old_nodes if i not in new_nodes],
        "removed_gpus": [k for k in old_gpus if k not in new["gpus"]],
        "order": order if order != old_order else None,
        "headline": new["headline"]
        if not old or old["headline"] != new["headline"]
        else None,
    }


def is_empty(delta: ClusterDeltaEvent) -> bool:
    return not (
        delta["nodes"]
        or delta["gpus"]
        or delta["removed_nodes"]
        or delta["removed_gpus"]
        or delta["order"] is not None
        or delta["headline"] is not None
    )


def changed_nodes(old: ClusterState | None, new: ClusterState) -> list[NodeLive]:
    """Nodes whose status, mode or GPUs' holders changed (for ``node.state``)."""
    if old is None:
        return []
    before = {n["id"]: n for n in old["nodes"]}
    out = []
    for node in new["nodes"]:
        prev = before.get(node["id"])
        if prev is None:
            continue
        if prev != node or any(
            k not in old["gpus"]
            or _structure(old["gpus"][k]) != _structure(new["gpus"][k])
            for k in node["gpus"]
        ):
            out.append(node)
    return out


# ------------------------------------------------------------------ the hub

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


_sync_redis: redis.Redis | None = None


def mark_queue_changed() -> None:
    """Called by services (after commit) when the queue changed; the next round
    tells the pages showing it (at most once per interval)."""
    global _sync_redis
    if _sync_redis is None:
        _sync_redis = redis.Redis.from_url(settings.REDIS_URL)
    try:
        _sync_redis.set(f"{settings.REDIS_PREFIX}:live:queue", "1")
    except redis.RedisError:
        # Pages notice at their next change or reload; the job's state is stored.
        log.warning("live: could not mark the queue changed", exc_info=True)


# ------------------------------------------------------------------ node feed


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


class NodeFeed:
    """The live side of one agent connection: throttled node and job updates
    built from its metrics frames, and its jobs' log chunks."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.throttle = Throttle(interval())
        self.pending: protocol.MetricsData | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.flushing: asyncio.Task[None] | None = None
        # GPU index -> [(attempt id, job id)] of the live allocations on the node.
        self.holders: dict[int, list[tuple[int, int]]] | None = None
        self.holders_at = 0.0
        self.sent = 0

    def invalidate(self) -> None:
        """Allocations on the node may have changed (launch, kill, start, exit)."""
        self.holders = None

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.pending = None

    async def offer(self, metrics: protocol.MetricsData) -> None:
        """A metrics frame arrived: publish it now, hold it (the latest of a new
        second that came too soon after the last update), or drop it (its second
        already went out)."""
        if time.time() - metrics.sampled_at > LIVE_MAX_AGE_S:
            return
        wait = self.throttle.decide(metrics.sampled_at, monotonic())
        if wait is None:
            return
        if wait <= 0:
            await self._publish(metrics)
            return
        self.pending = metrics
        if self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(wait, self._start_flush, loop)

    def _start_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self.flushing = loop.create_task(self._flush())

    async def _flush(self) -> None:
        self.timer = None
        metrics, self.pending = self.pending, None
        if metrics is None:
            return
        try:
            await self._publish(metrics)
        except Exception:
            log.warning("live: node %s update failed", self.node_id, exc_info=True)

    async def _holders(self) -> dict[int, list[tuple[int, int]]]:
        if self.holders is None or monotonic() - self.holders_at > HOLDERS_MAX_AGE_S:
            self.holders = await database_sync_to_async(node_holders)(self.node_id)
            self.holders_at = monotonic()
        return self.holders

    async def _publish(self, metrics: protocol.MetricsData) -> None:
        self.throttle.sent(metrics.sampled_at, monotonic())
        hub = Hub.current()
        watched = await hub.watched()
        if events.CLUSTER_GROUP in watched:
            # The aggregator's readings: fresher than the database's latest state
            # (written behind the live path, and skipped frames when it is slow).
            pipe = hub.redis.pipeline(transaction=False)
            pipe.hset(hub.readings_key, str(self.node_id), readings_json(metrics))
            pipe.expire(hub.readings_key, READINGS_TTL_S)
            await pipe.execute()
        node_group = events.node_group(self.node_id)
        jobs_watched = any(g.startswith("job.") for g in watched)
        if node_group not in watched and not jobs_watched:
            return
        holders = await self._holders()
        job_of = {a: j for pairs in holders.values() for a, j in pairs}
        layer = get_channel_layer()
        assert layer is not None
        if node_group in watched:
            gpus: list[GpuSampleLive] = [
                {
                    "index": s.index,
                    "util": _round(s.util_gpu),
                    "mem": s.memory_used_mib,
                    "mem_total": s.memory_total_mib,
                    "temp": _round(s.temperature_c),
                    "power": _round(s.power_w),
                    "lost": s.lost,
                    "procs": [
                        {
                            "pid": p.pid,
                            "mib": p.used_memory_mib,
                            "sm": p.sm_util,
                            "attempt": p.attempt_id,
                            "job": job_of.get(p.attempt_id)
                            if p.attempt_id is not None
                            else None,
                        }
                        for p in s.processes
                    ],
                }
                for s in metrics.gpus
            ]
            event: events.NodeMetricsEvent = {
                "type": "node.metrics",
                "node": self.node_id,
                "at": metrics.sampled_at,
                "gpus": gpus,
            }
            await layer.group_send(node_group, dict(event))
            self.sent += 1
        if not jobs_watched:
            return
        per_job: dict[int, list[JobGpuLive]] = {}
        for s in metrics.gpus:
            on_gpu = holders.get(s.index, [])
            for attempt_id, job_id in on_gpu:
                own = [
                    p.used_memory_mib
                    for p in s.processes
                    if p.attempt_id == attempt_id and p.used_memory_mib is not None
                ]
                per_job.setdefault(job_id, []).append(
                    {
                        "key": livestate.gpu_key(self.node_id, s.index),
                        "node": self.node_id,
                        "index": s.index,
                        "util": _round(s.util_gpu),
                        "mem": s.memory_used_mib,
                        "mem_total": s.memory_total_mib,
                        "own_mib": sum(own) if own else None,
                        "temp": _round(s.temperature_c),
                        "power": _round(s.power_w),
                        "jobs": sorted({j for _, j in on_gpu}),
                    }
                )
        for job_id, job_gpus in per_job.items():
            group = events.job_group(job_id)
            if group in watched:
                job_event: events.JobMetricsEvent = {
                    "type": "job.metrics",
                    "job": job_id,
                    "node": self.node_id,
                    "at": metrics.sampled_at,
                    "gpus": job_gpus,
                }
                await layer.group_send(group, dict(job_event))
                self.sent += 1

    async def log_chunk(self, data: protocol.JobLogData, text: str) -> None:
        """A stored chunk of a job's output, to its page if someone watches it."""
        group = events.job_group(data.job_id)
        if group not in await Hub.current().watched():
            return
        layer = get_channel_layer()
        assert layer is not None
        event: events.JobLogEvent = {
            "type": "job.log",
            "job": data.job_id,
            "attempt": data.attempt_id,
            "node": self.node_id,
            "offset": data.offset,
            "data": text,
        }
        await layer.group_send(group, dict(event))

    async def progress(self, data: protocol.JobProgressData) -> None:
        """A stored progress report: its job's page, if someone watches it,
        fetches the progress line again."""
        group = events.job_group(data.job_id)
        if group not in await Hub.current().watched():
            return
        layer = get_channel_layer()
        assert layer is not None
        event: events.JobProgressEvent = {
            "type": "job.progress",
            "job": data.job_id,
            "step": data.step,
            "total": data.total,
            "at": data.at,
        }
        await layer.group_send(group, dict(event))


def readings_json(metrics: protocol.MetricsData) -> str:
    """A frame's readings as the aggregator reads them: each GPU's sample as
    ``Gpu.latest`` keeps it, by index, with the time it was taken."""
    return json.dumps(
        {
            "at": metrics.sampled_at,
            "gpus": {str(s.index): s.model_dump(mode="json") for s in metrics.gpus},
        }
    )


def node_holders(node_id: int) -> dict[int, list[tuple[int, int]]]:
    """GPU index -> [(attempt id, job id)] holding it, for one node (one query)."""
    out: dict[int, set[tuple[int, int]]] = {}
    for index, attempt_id, job_id in Allocation.objects.filter(
        released_at__isnull=True, gpu__node_id=node_id
    ).values_list("gpu__index", "attempt_id", "attempt__job_id"):
        out.setdefault(index, set()).add((attempt_id, job_id))
    return {i: sorted(pairs) for i, pairs in out.items()}
