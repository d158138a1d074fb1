"""The web process's metrics writer: every agent connection's frames, batched.

Written by each connection on its own (three statements and a commit each, one
database call per frame on the process's one database thread), the frames of a few
hundred nodes a second keep that thread busy all the time and the acks and live
updates queue behind it (bench/ingest.py, bench/README.md "Telemetry ingest").
So one ``MetricsWriter`` per event loop (one per web process) takes the frames of
all its connections and writes whatever arrived meanwhile in one call of
``services.record_metrics_many`` (one transaction, a fixed number of statements),
then the next batch: group commit, no timer. A quiet process writes each frame at
once; a busy one writes bigger batches, not more of them.

- A frame that starts a persistence interval (``persist``) is **durable**: its
  consumer awaits the batch that stored it before acking it, so an agent only
  drops from its spool what is committed.
- The others only update the GPUs' latest state: per node, a newer frame
  replaces one not yet written (a slow database skips frames rather than queueing
  them), and nobody waits for them.

If the web process dies with a batch unwritten: its durable frames were not acked,
so the agents send them again after reconnecting (nothing lost); its latest-only
frames are lost, which costs nothing, since the next frame after the reconnect (a
second later) is the GPUs' latest state again.
A batch that fails on the database being away fails every frame in it (their
consumers close 1013 and the agents replay); any other failure retries each frame
alone, so one bad frame costs only itself.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING

import redis
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError

from scheduler import services
from scheduler.pass_requests import _redis_client

if TYPE_CHECKING:
    from agents import protocol

log = logging.getLogger(__name__)

_DB_DOWN = (OperationalError, InterfaceError)


class MetricsWriter:
    """Batches metrics frames of every connection of one event loop."""

    def __init__(self) -> None:
        # node id -> its newest latest-only frame not yet taken by a batch
        self.latest: dict[int, protocol.MetricsData] = {}
        # durable frames not yet taken, with the future their consumer awaits
        self.durable: list[tuple[services.MetricsFrame, asyncio.Future[None]]] = []
        # resolved when the batch that takes what is pending now is written
        self.next_batch: asyncio.Future[None] | None = None
        # nodes of the batch being written, and its future
        self.writing: set[int] = set()
        self.written: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.batches = 0
        self.frames = 0

    def offer(self, node_id: int, metrics: protocol.MetricsData) -> None:
        """A latest-only frame: written with the next batch, unless a newer frame
        of the node replaces it first."""
        old = self.latest.get(node_id)
        if old is None or metrics.sampled_at >= old.sampled_at:
            self.latest[node_id] = metrics
        self._start()

    async def store(self, node_id: int, metrics: protocol.MetricsData) -> None:
        """A durable frame: returns once it is committed (history and latest
        state); raises what its batch raised."""
        done = asyncio.get_running_loop().create_future()
        self.durable.append(
            (services.MetricsFrame(node_id, metrics, persist=True), done)
        )
        self._start()
        await done

    async def flushed(self, node_id: int) -> None:
        """Wait until the node's frames taken so far are written (a disconnect:
        the latest state the agent sent is stored before it is said to have
        left). Never raises."""
        waits = []
        if node_id in self.writing and self.written is not None:
            waits.append(self.written)
        if node_id in self.latest or any(f.node_id == node_id for f, _ in self.durable):
            self._start()
            if self.next_batch is not None:
                waits.append(self.next_batch)
        for fut in waits:
            await asyncio.wait([fut], timeout=10)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.next_batch is None:
            self.next_batch = loop.create_future()
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._run())

    async def _run(self) -> None:
        while self.latest or self.durable:
            latest, self.latest = self.latest, {}
            durable, self.durable = self.durable, []
            batch_done, self.next_batch = self.next_batch, None
            frames = [f for f, _ in durable]
            frames += [
                services.MetricsFrame(n, m, persist=False) for n, m in latest.items()
            ]
            self.writing = {f.node_id for f in frames}
            self.written = batch_done
            failed: dict[int, Exception] = {}
            try:
                failed = await database_sync_to_async(_write)(frames)
            except Exception as exc:
                failed = dict.fromkeys(range(len(frames)), exc)
            self.batches += 1
            self.frames += len(frames)
            self.writing, self.written = set(), None
            for i, (_, done) in enumerate(durable):
                if done.done():
                    continue
                if i in failed:
                    done.set_exception(failed[i])
                else:
                    done.set_result(None)
            if batch_done is not None and not batch_done.done():
                batch_done.set_result(None)
            for i in range(len(durable), len(frames)):
                if i in failed:
                    log.warning(
                        "node %s: latest metrics not stored: %r",
                        frames[i].node_id,
                        failed[i],
                    )


def frames_key() -> str:
    """The Redis counter of metrics frames stored by every web process (read by
    /metrics as ``gpulab_ingest_frames_total``: its rate is the frames per
    second of the whole portal)."""
    return f"{settings.REDIS_PREFIX}:ingest:frames"


def _count(stored: int) -> None:
    """Add a batch's stored frames to the shared counter; Redis away: skipped
    (a figure for monitoring, not worth failing the batch)."""
    if stored <= 0:
        return
    try:
        _redis_client().incrby(frames_key(), stored)
    except redis.RedisError as exc:
        log.debug("ingest counter not updated: %r", exc)


def _write(frames: list[services.MetricsFrame]) -> dict[int, Exception]:
    """One batch (counted in ``frames_key``); on an error other than the
    database being away (raised: the whole batch fails), each frame alone.
    Returns the frames (by position) that failed, with their errors."""
    failed = _write_batch(frames)
    _count(len(frames) - len(failed))
    return failed


def _write_batch(frames: list[services.MetricsFrame]) -> dict[int, Exception]:
    try:
        services.record_metrics_many(frames)
        return {}
    except _DB_DOWN:
        raise
    except Exception as exc:
        if len(frames) == 1:
            return {0: exc}
        log.exception(
            "metrics batch of %d frames failed; storing each alone", len(frames)
        )
    failed: dict[int, Exception] = {}
    for i, frame in enumerate(frames):
        try:
            services.record_metrics_many([frame])
        except _DB_DOWN:
            raise
        except Exception as exc:
            failed[i] = exc
    return failed


_writers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, MetricsWriter] = (
    weakref.WeakKeyDictionary()
)


def writer() -> MetricsWriter:
    """This event loop's writer (one per web process)."""
    loop = asyncio.get_running_loop()
    found = _writers.get(loop)
    if found is None:
        found = _writers[loop] = MetricsWriter()
    return found
