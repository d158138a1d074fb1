"""The live side of one agent connection: throttled node and job updates built from
its metrics frames, and its jobs' log chunks (``NodeFeed``), each sent only while
some browser watches the group."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import TYPE_CHECKING

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from scheduler import events, livestate
from scheduler.live.hub import Hub
from scheduler.live.timing import (
    HOLDERS_MAX_AGE_S,
    LIVE_MAX_AGE_S,
    READINGS_TTL_S,
    interval,
    monotonic,
)
from scheduler.models import Allocation

if TYPE_CHECKING:
    from agents import protocol
    from scheduler.events import GpuSampleLive, JobGpuLive

log = logging.getLogger(__name__)


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
    frame after one slow one, and seconds of lag would pile up).
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
        event: events.JobLogEvent = {
            "type": "job.log",
            "job": data.job_id,
            "attempt": data.attempt_id,
            "node": self.node_id,
            "offset": data.offset,
            "data": text,
        }
        await _to_job_page(data.job_id, dict(event))

    async def progress(self, data: protocol.JobProgressData) -> None:
        """A stored progress report: its job's page, if someone watches it,
        fetches the progress line again."""
        event: events.JobProgressEvent = {
            "type": "job.progress",
            "job": data.job_id,
            "step": data.step,
            "total": data.total,
            "at": data.at,
        }
        await _to_job_page(data.job_id, dict(event))


async def _to_job_page(job_id: int, event: dict[str, object]) -> None:
    """Send ``event`` to the job's group, only when someone watches it (a
    ``group_send`` costs two Redis round trips even to an empty group)."""
    group = events.job_group(job_id)
    if group not in await Hub.current().watched():
        return
    layer = get_channel_layer()
    assert layer is not None
    await layer.group_send(group, event)


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
