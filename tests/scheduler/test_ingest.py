"""The batched metrics ingest: ``services.record_metrics_many`` (many nodes' frames
in one transaction) and the web process's ``ingest.MetricsWriter`` (group commit of
what every connection received meanwhile; durable frames awaited, latest-only ones
coalesced per node), on real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from unittest import mock

import pytest
from channels.db import database_sync_to_async
from django.db import OperationalError, connections

from agents import protocol
from scheduler import ingest, services
from scheduler.models import Attempt, Gpu, GpuSample, Node
from tests.conftest import make_node
from tests.factories import JobFactory, start_job


def frame(node: Node, at: float, util: float, **extra: Any) -> protocol.MetricsData:
    return protocol.MetricsData(
        sampled_at=at,
        gpus=[
            protocol.GpuSample(index=g.index, uuid=g.uuid, util_gpu=util, **extra)
            for g in node.gpus.order_by("index")
        ],
    )


def stored(node: Node) -> list[tuple[int, float, float | None]]:
    return sorted(
        (s.gpu.index, s.at.timestamp(), s.util_gpu)
        for s in GpuSample.objects.filter(gpu__node=node).select_related("gpu")
    )


@pytest.mark.django_db
def test_one_batch_takes_many_nodes_in_a_fixed_number_of_queries(
    django_assert_max_num_queries: Any,
) -> None:
    nodes = [make_node(f"n{i}", 2)[0] for i in range(20)]
    t0 = float(int(time.time()) - 5)
    frames = [
        services.MetricsFrame(n.pk, frame(n, t0, 10.0), persist=True) for n in nodes
    ]
    frames += [services.MetricsFrame(n.pk, frame(n, t0 + 1, 20.0)) for n in nodes]
    # GPUs, latest, nodes' last seen, samples (+ savepoint), with a transaction
    with django_assert_max_num_queries(10):
        assert services.record_metrics_many(frames) == 80
    for node in nodes:
        assert stored(node) == [(0, t0, 10.0), (1, t0, 10.0)]
        assert {g.latest["util_gpu"] for g in node.gpus.all()} == {20.0}
        assert {g.latest_at.timestamp() for g in node.gpus.all()} == {t0 + 1}
        node.refresh_from_db()
        assert node.last_seen_at is not None


@pytest.mark.django_db
def test_an_older_frame_never_overwrites_the_latest_state_in_or_across_batches() -> (
    None
):
    node, _ = make_node("n", 1)
    t0 = float(int(time.time()) - 5)
    # in one batch, whatever the order they came in
    services.record_metrics_many(
        [
            services.MetricsFrame(node.pk, frame(node, t0 + 2, 30.0)),
            services.MetricsFrame(node.pk, frame(node, t0, 10.0), persist=True),
        ]
    )
    # a replay, later
    services.record_metrics_many(
        [services.MetricsFrame(node.pk, frame(node, t0 + 1, 20.0))]
    )
    gpu = node.gpus.get()
    assert (gpu.latest["util_gpu"], gpu.latest_at.timestamp()) == (30.0, t0 + 2)
    assert stored(node) == [(0, t0, 10.0)]


@pytest.mark.django_db
def test_a_batch_keeps_peaks_lost_gpus_and_foreign_processes(alice: Any) -> None:
    node, _ = make_node("n", 2)
    other, _ = make_node("m", 1)
    attempt = start_job(JobFactory(owner=alice, gpus=1), node)
    gpu = Gpu.objects.get(allocations__attempt=attempt, allocations__slot=0)
    t0 = float(int(time.time()) - 5)
    procs = protocol.MetricsData(
        sampled_at=t0,
        gpus=[
            protocol.GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                processes=[
                    protocol.ProcessSample(
                        pid=1, used_memory_mib=7000, attempt_id=attempt.pk
                    )
                ],
            ),
        ],
    )
    # the other node claims the attempt on its GPU: kept as a foreign process
    claim = frame(other, t0, 50.0)
    claim = claim.model_copy(
        update={
            "gpus": [
                claim.gpus[0].model_copy(
                    update={
                        "processes": [
                            protocol.ProcessSample(
                                pid=2, used_memory_mib=9000, attempt_id=attempt.pk
                            )
                        ]
                    }
                )
            ]
        }
    )
    lost = frame(node, t0 + 1, 0.0, lost=True)
    services.record_metrics_many(
        [
            services.MetricsFrame(node.pk, procs, persist=True),
            services.MetricsFrame(other.pk, claim, persist=True),
            services.MetricsFrame(node.pk, lost),
        ]
    )
    attempt.refresh_from_db()
    assert attempt.peak_memory_mib == 7000  # not the other node's 9000
    foreign = GpuSample.objects.get(gpu__node=other)
    assert foreign.processes[0]["attempt_id"] is None
    assert not Gpu.objects.filter(node=node, present=True).exists()


def test_every_field_of_a_sample_is_stored_as_sent(alice: Any) -> None:
    """The batch travels as one JSON document (``jsonb_to_recordset``): every
    column and the latest state come back exactly, floats, bigints, nulls and
    processes included; a GPU left out of a frame keeps its latest state."""
    node, _ = make_node("n", 2)
    attempt = start_job(JobFactory(owner=alice, gpus=1), node)
    gpu = Gpu.objects.get(allocations__attempt=attempt, allocations__slot=0)
    t0 = int(time.time()) - 5 + 0.123456  # microseconds survive
    sample = protocol.GpuSample(
        index=gpu.index,
        uuid=gpu.uuid,
        util_gpu=0.1 + 0.2,  # 0.30000000000000004
        util_mem=99.99,
        memory_used_mib=81_000,
        memory_total_mib=81_920,
        temperature_c=-3.5,
        power_w=1e-7,
        power_limit_w=400.0,
        sm_clock_mhz=1410,
        pcie_rx_kib_s=2**40,
        pcie_tx_kib_s=0,
        ecc_uncorrected=None,
        energy_mj=2**62,
        lost=False,
        processes=[
            protocol.ProcessSample(
                pid=4242, used_memory_mib=7000, sm_util=12.5, attempt_id=attempt.pk
            ),
            protocol.ProcessSample(pid=7, used_memory_mib=None, sm_util=None),
        ],
    )
    services.record_metrics_many(
        [
            services.MetricsFrame(
                node.pk,
                protocol.MetricsData(sampled_at=t0, gpus=[sample]),
                persist=True,
            )
        ]
    )
    row = GpuSample.objects.get(gpu=gpu)
    sent = sample.model_dump(mode="json")
    assert row.at.timestamp() == t0
    for column in (
        "util_gpu", "util_mem", "memory_used_mib", "temperature_c", "power_w",
        "sm_clock_mhz", "pcie_rx_kib_s", "pcie_tx_kib_s", "ecc_uncorrected",
        "energy_mj", "lost", "processes",
    ):  # fmt: skip
        assert getattr(row, column) == sent[column], column
    gpu.refresh_from_db()
    assert gpu.latest == sent
    assert gpu.latest_at.timestamp() == t0
    other = Gpu.objects.get(node=node, index=1 - gpu.index)
    assert other.latest_at is None  # not in the frame: untouched


@pytest.fixture(autouse=False)
async def _close_db_connections() -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_close_db_connections")
async def test_the_writer_batches_many_connections_and_acks_after_commit() -> None:
    nodes = [
        (await database_sync_to_async(make_node)(f"n{i}", 2))[0] for i in range(30)
    ]
    t0 = float(int(time.time()) - 5)
    frames = [await database_sync_to_async(frame)(n, t0, 10.0) for n in nodes]
    latest = [await database_sync_to_async(frame)(n, t0 + 1, 20.0) for n in nodes]
    writer = ingest.MetricsWriter()
    with mock.patch.object(ingest, "_writers", {asyncio.get_running_loop(): writer}):
        for n, f in zip(nodes, latest, strict=True):
            ingest.writer().offer(n.pk, f)
        await asyncio.gather(
            *(
                ingest.writer().store(n.pk, f)
                for n, f in zip(nodes, frames, strict=True)
            )
        )
        # each store returned after its commit: its samples are there
        count = await database_sync_to_async(
            GpuSample.objects.filter(gpu__node__in=nodes).count
        )()
        assert count == 60
        await writer.flushed(nodes[0].pk)
    # 60 frames of 30 connections in a couple of batches, not 60 writes
    assert writer.frames == 60
    assert writer.batches <= 3
    utils = await database_sync_to_async(
        lambda: set(
            Gpu.objects.filter(node__in=nodes).values_list(
                "latest__util_gpu", flat=True
            )
        )
    )()
    assert utils == {20.0}


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_close_db_connections")
async def test_the_writer_keeps_a_nodes_newest_latest_frame_only() -> None:
    node, _ = await database_sync_to_async(make_node)("n", 1)
    t0 = float(int(time.time()) - 5)
    writer = ingest.MetricsWriter()
    calls: list[list[services.MetricsFrame]] = []
    real = services.record_metrics_many

    def spy(frames: list[services.MetricsFrame]) -> int:
        calls.append(frames)
        return real(frames)

    frames = [await database_sync_to_async(frame)(node, t0 + i, i) for i in range(5)]
    # an older one arriving late does not replace the newest pending
    frames.append(await database_sync_to_async(frame)(node, t0, 99.0))
    with mock.patch.object(services, "record_metrics_many", spy):
        for f in frames:  # all before the writer runs: one batch
            writer.offer(node.pk, f)
        await writer.flushed(node.pk)
    assert [[f.metrics.sampled_at for f in c] for c in calls] == [[t0 + 4]]
    gpu = await database_sync_to_async(node.gpus.get)()
    assert gpu.latest["util_gpu"] == 4.0


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_close_db_connections")
async def test_a_failing_batch_fails_the_durable_frames_it_did_not_store() -> None:
    good, _ = await database_sync_to_async(make_node)("good", 1)
    bad, _ = await database_sync_to_async(make_node)("bad", 1)
    t0 = float(int(time.time()) - 5)
    writer = ingest.MetricsWriter()
    real = services.record_metrics_many

    def flaky(frames: list[services.MetricsFrame]) -> int:
        if any(f.node_id == bad.pk for f in frames):
            raise ValueError("bad frame")
        return real(frames)

    with mock.patch.object(services, "record_metrics_many", flaky):
        results = await asyncio.gather(
            writer.store(good.pk, await database_sync_to_async(frame)(good, t0, 1.0)),
            writer.store(bad.pk, await database_sync_to_async(frame)(bad, t0, 1.0)),
            return_exceptions=True,
        )
    # the good one stored alone after the batch failed; the bad one raised
    assert results[0] is None
    assert isinstance(results[1], ValueError)
    assert (
        await database_sync_to_async(GpuSample.objects.filter(gpu__node=good).count)()
        == 1
    )

    # the database away: every frame of the batch fails (the agent replays)
    def down(frames: list[services.MetricsFrame]) -> int:
        raise OperationalError("gone")

    with mock.patch.object(services, "record_metrics_many", down):
        results = await asyncio.gather(
            writer.store(
                good.pk, await database_sync_to_async(frame)(good, t0 + 10, 1.0)
            ),
            writer.store(
                bad.pk, await database_sync_to_async(frame)(bad, t0 + 10, 1.0)
            ),
            return_exceptions=True,
        )
    assert all(isinstance(r, OperationalError) for r in results)
    assert not await database_sync_to_async(Attempt.objects.exists)()
