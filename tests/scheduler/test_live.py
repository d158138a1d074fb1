"""Live fan-out (scheduler.live): the per-node throttle, the cluster deltas, and the
aggregator's "one message per interval, whatever the number of web processes",
against real Redis and PostgreSQL (two ``Hub``s stand for two web processes: each
has its own Redis connection, as a process would)."""

from __future__ import annotations

import asyncio
import copy
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.db import connections

from agents import protocol
from scheduler import events, live, livestate, services
from tests.conftest import make_node
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.events import ClusterState

TIMEOUT = 5


# ------------------------------------------------------------------ pure parts


@pytest.mark.parametrize(
    ("sent", "sampled_at", "now", "decision"),
    [
        (None, 100.2, 0.0, 0.0),  # nothing sent yet: go
        ((100.2, 50.0), 101.1, 51.0, 0.0),  # the next second's sample: go
        ((100.2, 50.0), 100.9, 50.7, None),  # the same second: dropped
        ((100.2, 50.0), 101.1, 50.2, 0.3),  # a new second, too soon: hold
        ((100.9, 50.0), 101.1, 50.8, 0.0),  # counted on samples, not arrivals
        ((100.2, 50.0), 30.0, 51.0, 0.0),  # the agent's clock went back: go
    ],
)
def test_the_throttle_lets_one_sample_a_second_through(
    sent: tuple[float, float] | None,
    sampled_at: float,
    now: float,
    decision: float | None,
) -> None:
    throttle = live.Throttle(1.0)
    if sent is not None:
        throttle.sent(*sent)

    result = throttle.decide(sampled_at, now)

    assert result == (None if decision is None else pytest.approx(decision))


def test_a_late_frame_delays_at_most_the_next_one_a_little() -> None:
    """Frames a second apart; one arrives 0.8 s late: the next waits out half a
    second from it, and the ones after go at once (no lag piles up)."""
    throttle = live.Throttle(1.0)
    waits = []
    for k, delay in enumerate([0.05, 0.05, 0.85, 0.05, 0.05, 0.05]):
        arrival = 1000.0 + k + delay
        wait = throttle.decide(1000.0 + k, arrival)
        assert wait is not None
        waits.append(round(wait, 2))
        throttle.sent(1000.0 + k, arrival + wait)

    assert waits == [0.0, 0.0, 0.0, 0.3, 0.0, 0.0]


def gpu(key: str, **changes: Any) -> events.GpuLive:
    entry: events.GpuLive = {
        "key": key,
        "node": int(key.split(":")[0]),
        "index": int(key.split(":")[1]),
        "model": "A100",
        "mem_total": 81920,
        "util": 0,
        "mem": 0,
        "temp": 30,
        "power": 50,
        "at": 1000.0,
        "stale": False,
        "state": "free",
        "reason": "",
        "load": 0,
        "jobs": [],
        "foreign": [],
    }
    entry.update(changes)  # type: ignore[typeddict-item]
    return entry


def state(seq: int, gpus: list[events.GpuLive], pending: int = 0) -> ClusterState:
    nodes: dict[int, list[str]] = {}
    for g in gpus:
        nodes.setdefault(g["node"], []).append(g["key"])
    return {
        "seq": seq,
        "at": 1000.0 + seq,
        "nodes": [
            {
                "id": n,
                "name": f"n{n}",
                "status": "up",
                "status_label": "up",
                "mode": "",
                "connected": True,
                "gpus": keys,
            }
            for n, keys in nodes.items()
        ],
        "gpus": {g["key"]: g for g in gpus},
        "headline": {
            "gpus": len(gpus),
            "busy": 0,
            "shared": 0,
            "free": len(gpus),
            "unavailable": 0,
            "running": 0,
            "starting": 0,
            "pending": pending,
            "nodes": len(nodes),
            "nodes_up": len(nodes),
            "oldest_pending_at": None,
        },
    }


def test_a_first_delta_has_everything_from_base_zero() -> None:
    new = state(1, [gpu("1:0"), gpu("1:1")])

    delta = live.diff(None, new)

    assert (delta["base"], delta["seq"]) == (0, 1)
    assert [g["key"] for g in delta["gpus"]] == ["1:0", "1:1"]
    assert delta["headline"] == new["headline"]
    assert delta["order"] == [1]


def test_a_delta_leaves_out_a_gpu_whose_reading_only_got_newer() -> None:
    old = state(1, [gpu("1:0"), gpu("1:1")])
    new = state(2, [gpu("1:0", at=2000.0), gpu("1:1", util=93, load=4)])

    delta = live.diff(old, new)

    assert (delta["base"], delta["seq"]) == (1, 2)
    assert [g["key"] for g in delta["gpus"]] == ["1:1"]
    assert delta["headline"] is None
    assert delta["order"] is None
    assert not live.is_empty(delta)


def test_a_delta_names_what_went_away_and_the_new_headline() -> None:
    old = state(1, [gpu("1:0"), gpu("2:0")])
    new = state(2, [gpu("1:0")], pending=3)

    delta = live.diff(old, new)

    assert delta["removed_gpus"] == ["2:0"]
    assert delta["removed_nodes"] == [2]
    assert delta["headline"] is not None
    assert delta["headline"]["pending"] == 3


def test_an_unchanged_state_is_an_empty_delta() -> None:
    old = state(1, [gpu("1:0")])
    new = copy.deepcopy(old)
    new["seq"] = 2

    assert live.is_empty(live.diff(old, new))


def test_node_state_goes_out_only_for_a_change_of_holders_not_of_readings() -> None:
    holder: events.HolderLive = {
        "id": 7,
        "name": "x",
        "owner": "alice",
        "declared_mib": None,
        "used_mib": 10,
    }
    old = state(1, [gpu("1:0"), gpu("2:0")])
    new = state(
        2,
        [
            gpu("1:0", util=50, load=2),
            gpu("2:0", state="busy", jobs=[holder]),
        ],
    )
    newer = copy.deepcopy(new)
    newer["gpus"]["2:0"]["jobs"][0]["used_mib"] = 2000  # only its memory grew

    assert [n["id"] for n in live.changed_nodes(old, new)] == [2]
    assert live.changed_nodes(new, newer) == []


# ------------------------------------------------------------------ with Redis


@pytest.fixture
async def _close_db_connections(clean_live: None) -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


async def listen(group: str) -> str:
    """A raw channel in ``group`` (what a browser's consumer would be)."""
    layer = get_channel_layer()
    assert layer is not None
    channel = await layer.new_channel()
    await layer.group_add(group, channel)
    return channel


async def receive(channel: str, timeout: float = TIMEOUT) -> dict[str, Any]:
    layer = get_channel_layer()
    assert layer is not None
    return dict(await asyncio.wait_for(layer.receive(channel), timeout))


async def nothing(channel: str, timeout: float = 1.0) -> bool:
    try:
        await receive(channel, timeout)
    except TimeoutError:
        return True
    return False


async def watch(hub: live.Hub, *groups: str) -> None:
    """Mark groups watched as a subscribed browser would (without starting the
    hub's ticker, so the test runs the rounds itself)."""
    await hub.redis.zadd(hub.watch_key, dict.fromkeys(groups, time.time() + 60))
    hub.forget_watched()


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_two_processes_publish_one_cluster_message_per_interval(
    settings: Any, _close_db_connections: None
) -> None:
    settings.GPULAB_LIVE_INTERVAL = 5.0  # a round that takes a while still fits
    await database_sync_to_async(make_node)("node-a", 2)
    first, second = live.Hub(), live.Hub()  # two web processes
    await watch(first, events.CLUSTER_GROUP)
    channel = await listen(events.CLUSTER_GROUP)

    published = await asyncio.gather(first.publish_once(), second.publish_once())
    # Both try again at once: the interval is not up.
    again = await asyncio.gather(first.publish_once(), second.publish_once())
    delta = await receive(channel)

    assert sorted(published) == [0, 1]  # one built and sent seq 1, one stood by
    assert all(r <= 0 for r in again)
    assert delta["type"] == "cluster.delta"
    assert (delta["base"], delta["seq"]) == (0, 1)
    assert [g["key"] for g in delta["gpus"]] == [
        livestate.gpu_key(delta["nodes"][0]["id"], i) for i in (0, 1)
    ]
    assert await nothing(channel)
    stored = await second.stored_state()
    assert stored is not None and stored["seq"] == 1


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_a_round_sends_the_change_and_node_state_then_nothing_when_quiet(
    settings: Any, alice: User, _close_db_connections: None
) -> None:
    settings.GPULAB_LIVE_INTERVAL = 5.0
    node, _ = await database_sync_to_async(make_node)("node-a", 2)
    hub = live.Hub()
    await watch(hub, events.CLUSTER_GROUP, events.node_group(node.pk))
    cluster = await listen(events.CLUSTER_GROUP)
    node_channel = await listen(events.node_group(node.pk))
    assert await hub.publish_once() == 1
    await receive(cluster)

    job = await database_sync_to_async(JobFactory)(owner=alice, name="<i>x</i>")
    await database_sync_to_async(start_job)(job, node)
    await hub.redis.delete(hub.gate_key)  # the interval is up
    seq = await hub.publish_once()
    delta = await receive(cluster)
    node_state = await receive(node_channel)
    await hub.redis.delete(hub.gate_key)
    quiet = await hub.publish_once()

    assert seq == 2
    assert (delta["base"], delta["seq"]) == (1, 2)
    busy = [g for g in delta["gpus"] if g["jobs"]]
    assert [(g["state"], g["jobs"][0]["id"], g["jobs"][0]["name"]) for g in busy] == [
        ("busy", job.pk, "<i>x</i>")
    ]
    assert delta["headline"]["busy"] == 1
    assert node_state["type"] == "node.state"
    assert node_state["node"]["id"] == node.pk
    assert quiet == 0  # nothing changed: nothing sent
    assert await nothing(cluster)


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_a_marked_queue_is_announced_once(
    settings: Any, _close_db_connections: None
) -> None:
    hub = live.Hub()
    await watch(hub, events.QUEUE_GROUP)
    channel = await listen(events.QUEUE_GROUP)
    await hub.publish_once()  # a first state

    await database_sync_to_async(live.mark_queue_changed)()
    await hub.redis.delete(hub.gate_key)
    await hub.publish_once()
    message = await receive(channel)
    await hub.redis.delete(hub.gate_key)
    await hub.publish_once()

    assert message["type"] == "queue.changed"
    assert await nothing(channel)


class Tab:
    """A hub member standing for a browser consumer."""

    def __init__(self) -> None:
        self.rejoined: list[bool] = []

    async def rejoin(self, *, lost: bool) -> None:
        self.rejoined.append(lost)


@pytest.mark.anyio
async def test_each_hub_notices_once_that_redis_lost_its_data(clean_live: None) -> None:
    first, second = live.Hub(), live.Hub()  # two web processes
    tab = Tab()
    first.add_member(tab)
    first.local["node.7"] += 1  # a subscription of first's
    seen = [await first.lost_data(), await second.lost_data(), await first.lost_data()]

    # Redis restarted: no data at all (the epoch, the watch set) any more.
    await first.redis.delete(first.epoch_key, first.watch_key)
    after = [await second.lost_data(), await first.lost_data(), await first.lost_data()]
    await first.recover()
    await first.rejoin_members(lost=False)  # the ticker's periodic rejoin

    assert seen == [False, False, False]  # first sightings, then no change
    assert after == [True, True, False]  # each process once
    assert tab.rejoined == [True, False]
    assert "node.7" in await first.watched()  # watched again at once


def metrics_frame(node: Any, at: float, util: float, attempt: int | None = None) -> Any:
    gpus = list(node.gpus.order_by("index"))
    return protocol.MetricsData(
        sampled_at=at,
        gpus=[
            protocol.GpuSample(
                index=g.index,
                uuid=g.uuid,
                util_gpu=util,
                memory_used_mib=1000,
                memory_total_mib=g.memory_total_mib,
                processes=[
                    protocol.ProcessSample(
                        pid=100 + g.index, used_memory_mib=900, attempt_id=attempt
                    )
                ]
                if g.index == 0
                else [],
            )
            for g in gpus
        ],
    )


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_an_arrays_cancel_tells_the_watched_task_pages_only(
    alice: User, _close_db_connections: None
) -> None:
    await database_sync_to_async(make_node)("node-a", 2)
    request = services.JobRequest(name="sweep", command="true", workdir="/tmp/w")
    array = await database_sync_to_async(services.submit_array)(alice, request, "0-2")
    ids = await database_sync_to_async(
        lambda: sorted(array.tasks.values_list("pk", flat=True))
    )()
    await watch(live.Hub.current(), events.job_group(ids[0]))
    watched = await listen(events.job_group(ids[0]))
    unwatched = await listen(events.job_group(ids[1]))  # in its group, not watched

    await database_sync_to_async(services.cancel_array)(array.pk, by=alice)

    assert await receive(watched) == {
        "type": "job.status",
        "job_id": ids[0],
        "status": "cancelled",
        "message": "cancelled",
    }
    assert await nothing(unwatched)


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_a_node_feed_sends_nothing_while_nobody_watches(
    settings: Any, _close_db_connections: None
) -> None:
    node, _ = await database_sync_to_async(make_node)("node-a", 2)
    feed = live.NodeFeed(node.pk)
    live.Hub.current().forget_watched()
    channel = await listen(events.node_group(node.pk))  # in the group, not watched

    await feed.offer(await database_sync_to_async(metrics_frame)(node, time.time(), 5))

    assert feed.sent == 0
    assert await nothing(channel)
    feed.close()


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_a_node_feed_sends_one_update_a_second_of_samples(
    settings: Any, alice: User, _close_db_connections: None
) -> None:
    settings.GPULAB_LIVE_INTERVAL = 4.0  # a slow machine still fits in a period
    node, _ = await database_sync_to_async(make_node)("node-a", 2)
    job = await database_sync_to_async(JobFactory)(owner=alice)
    attempt = await database_sync_to_async(start_job)(job, node)
    hub = live.Hub.current()
    await watch(hub, events.node_group(node.pk), events.job_group(job.pk))
    node_channel = await listen(events.node_group(node.pk))
    job_channel = await listen(events.job_group(job.pk))
    feed = live.NodeFeed(node.pk)
    start = (time.time() // 4) * 4  # the start of a 4 s slot, just past
    times = [start, start + 1, start + 2, start + 4.5, start + 4.6]
    frames = [
        await database_sync_to_async(metrics_frame)(node, at, float(10 * n), attempt.pk)
        for n, at in enumerate(times, 1)
    ]

    for frame in frames:  # all at once: one slot, then the next slot twice
        await feed.offer(frame)
    first = await receive(node_channel)
    job_first = await receive(job_channel)
    held = await receive(node_channel)  # half a period after the first

    assert first["type"] == "node.metrics"
    assert first["at"] == pytest.approx(times[0])
    # frames 2 and 3 were of the first slot: dropped; the next slot's latest won
    assert held["at"] == pytest.approx(times[4])
    assert [g["util"] for g in held["gpus"]] == [50.0, 50.0]
    assert held["gpus"][0]["procs"] == [
        {"pid": 100, "mib": 900, "sm": None, "attempt": attempt.pk, "job": job.pk}
    ]
    # the job's update: only its GPU, with its own processes' memory
    assert job_first["type"] == "job.metrics"
    assert [(g["index"], g["own_mib"], g["jobs"]) for g in job_first["gpus"]] == [
        (0, 900, [job.pk])
    ]
    assert await nothing(node_channel, 3.0)
    assert feed.sent == 4  # two node updates, two job updates
    feed.close()


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_a_replayed_old_frame_is_not_shown_live(
    settings: Any, _close_db_connections: None
) -> None:
    node, _ = await database_sync_to_async(make_node)("node-a", 1)
    hub = live.Hub.current()
    await watch(hub, events.node_group(node.pk))
    channel = await listen(events.node_group(node.pk))
    feed = live.NodeFeed(node.pk)
    old = time.time() - live.LIVE_MAX_AGE_S - 60

    await feed.offer(await database_sync_to_async(metrics_frame)(node, old, 50))

    assert await nothing(channel)
    feed.close()


@pytest.mark.django_db
def test_the_cluster_state_is_four_queries_whatever_the_size(
    alice: User, django_assert_num_queries: Any
) -> None:
    nodes = [make_node(f"node-{i}", 4)[0] for i in range(5)]
    for node in nodes[:3]:
        start_job(JobFactory(owner=alice), node)
    JobFactory(owner=alice)  # waiting

    with django_assert_num_queries(4):
        snapshot = livestate.cluster_state()

    assert snapshot["headline"]["gpus"] == 20
    assert snapshot["headline"]["busy"] == 3
    assert snapshot["headline"]["pending"] == 1
    assert snapshot["headline"]["free"] == 17
    assert [n["name"] for n in snapshot["nodes"]] == [f"node-{i}" for i in range(5)]


@pytest.mark.django_db
def test_the_cluster_state_says_what_each_gpu_is_doing(alice: User, bob: User) -> None:
    from scheduler.models import Gpu, Node

    node_a, _ = make_node("node-a", 4)
    node_b, _ = make_node("node-b", 1)
    attempt = start_job(
        JobFactory(owner=alice, name="mine", gpu_memory_mib=4096), node_a
    )
    gpus = {g.index: g for g in node_a.gpus.all()}
    now = time.time()
    Gpu.objects.filter(pk=gpus[0].pk).update(
        latest={
            "util_gpu": 93.4,
            "memory_used_mib": 5000,
            "temperature_c": 71.6,
            "power_w": 301.2,
            "processes": [
                {"pid": 10, "used_memory_mib": 3000, "attempt_id": attempt.pk},
                {"pid": 99, "used_memory_mib": 700, "attempt_id": None},
            ],
        },
        latest_at=datetime.fromtimestamp(now, tz=UTC),
    )
    Gpu.objects.filter(pk=gpus[1].pk).update(present=False)
    services.set_node_mode(node_b.pk, "maintenance", by=None)
    Node.objects.filter(pk=node_a.pk).update(connected=True)

    snapshot = livestate.cluster_state(now=now)
    g = snapshot["gpus"]
    key = livestate.gpu_key

    busy = g[key(node_a.pk, 0)]
    assert (busy["state"], busy["util"], busy["load"], busy["temp"]) == (
        "busy",
        93,
        4,
        72,
    )
    assert busy["jobs"] == [
        {
            "id": attempt.job_id,
            "name": "mine",
            "owner": "alice",
            "declared_mib": 4096,
            "used_mib": 3000,
        }
    ]
    assert busy["foreign"] == [{"pid": 99, "mib": 700}]
    assert not busy["stale"]
    assert (g[key(node_a.pk, 1)]["state"], g[key(node_a.pk, 1)]["reason"]) == (
        "unavailable",
        "GPU lost",
    )
    assert g[key(node_a.pk, 2)]["stale"]  # no reading yet
    assert g[key(node_b.pk, 0)]["reason"] == "node in maintenance"
    assert snapshot["headline"]["unavailable"] == 2
    assert snapshot["headline"]["free"] == 2


@pytest.mark.django_db
def test_newer_live_readings_win_over_the_stored_ones() -> None:
    from scheduler.models import Gpu

    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    Gpu.objects.filter(pk=gpu.pk).update(
        latest={"util_gpu": 10.0}, latest_at=datetime.fromtimestamp(1000, tz=UTC)
    )
    key = livestate.gpu_key(node.pk, 0)
    newer = {node.pk: {"at": 2000.0, "gpus": {"0": {"util_gpu": 90.0}}}}
    older = {node.pk: {"at": 500.0, "gpus": {"0": {"util_gpu": 50.0}}}}

    fresh = livestate.cluster_state(readings=newer, now=2001.0)["gpus"][key]
    stored = livestate.cluster_state(readings=older, now=2001.0)["gpus"][key]

    assert (fresh["util"], fresh["at"]) == (90, 2000.0)
    assert (stored["util"], stored["at"]) == (10, 1000.0)


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_a_node_feed_keeps_the_aggregators_readings_while_the_cluster_is_watched(
    settings: Any, _close_db_connections: None
) -> None:
    node, _ = await database_sync_to_async(make_node)("node-a", 1)
    hub = live.Hub.current()
    await watch(hub, events.CLUSTER_GROUP)
    feed = live.NodeFeed(node.pk)
    now = time.time()

    await feed.offer(await database_sync_to_async(metrics_frame)(node, now, 64.0))
    published = await hub.publish_once()
    state = await hub.stored_state()

    assert published == 1
    assert state is not None
    gpu = state["gpus"][livestate.gpu_key(node.pk, 0)]
    assert (gpu["util"], gpu["at"]) == (64, pytest.approx(now))
    feed.close()
