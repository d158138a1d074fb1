"""Time limits, metrics spooled while disconnected, the spool cap, cut-off kills."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import TYPE_CHECKING, Any

import pytest
from agent_helpers import (
    DURABLE,
    Portal,
    await_until,
    launch_data,
    make_agent,
    running,
)

from agents.spool import Spool

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


async def test_time_limit_stops_the_job_and_reports_timeout(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        await portal.send(
            "job.launch",
            launch_data(11, "sleep 100", tmp_path, time_limit_s=1, grace_s=1),
        )
        started = (await await_until(lambda: portal.of("job.started", attempt_id=11)))[
            0
        ]
        exited = (
            await await_until(lambda: portal.of("job.exited", attempt_id=11), 10)
        )[0]
    data = exited["data"]
    assert data["reason"] == "timeout"
    assert data["exit_code"] == 143  # sleep honours SIGTERM: the real status
    assert "time limit of 1 s" in data["message"]
    # Counted from the start the agent reported, not from the launch frame; the
    # reason "timeout" (not "exited") shows the agent stopped it, no wall-clock
    # upper bound needed.
    ran = data["ended_at"] - started["data"]["started_at"]
    assert ran >= 1.0


async def test_time_limit_survives_an_agent_restart(
    portal: Portal, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    marker = tmp_path / "ignored-term"
    agent = make_agent(portal.url, state)
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        # The command ignores SIGTERM: the grace then SIGKILL apply (128 + 9).
        await portal.send(
            "job.launch",
            launch_data(
                12,
                f'trap "" TERM; touch {marker}; sleep 100 & wait; sleep 100',
                tmp_path,
                time_limit_s=2,
                grace_s=1,
            ),
        )
        await await_until(lambda: portal.of("job.started", attempt_id=12))
    # The agent is down when the limit passes; the job keeps running meanwhile.
    started_at = float((state / "jobs/12/started").read_text())
    await asyncio.sleep(max(0.0, started_at + 2.2 - time.time()))
    assert not (state / "jobs/12/exit_code").exists()
    agent = make_agent(portal.url, state)
    async with running(agent):
        exited = (
            await await_until(lambda: portal.of("job.exited", attempt_id=12), 10)
        )[0]
    assert exited["data"]["reason"] == "timeout"
    assert exited["data"]["exit_code"] == 137
    assert marker.exists()


async def test_metrics_spooled_while_disconnected_are_replayed_in_order(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state", spool_metrics_interval_s=0.2)
    async with running(agent):
        await await_until(lambda: portal.of("metrics"))
        await portal.stop()
        await await_until(lambda: not agent.connected)
        # ~0.1 s samples, one kept every 0.2 s.
        await await_until(lambda: len(agent.spool.droppable) >= 6, 10)
        spooled = [
            json.loads(agent.spool.entries[s]) for s in list(agent.spool.droppable)
        ]
        stamps = [m["data"]["sampled_at"] for m in spooled]
        assert all(b - a >= 0.15 for a, b in itertools.pairwise(stamps))
        await portal.start()

        def replayed() -> list[dict[str, Any]]:
            return [f for f in portal.of("metrics") if f["conn"] == 2]

        await await_until(lambda: len(replayed()) >= len(spooled) + 2)
        await await_until(lambda: not agent.spool.droppable)
        second = [f for f in portal.frames if f["conn"] == 2]
        assert second[0]["type"] == "hello"
        got = {f["seq"]: f for f in replayed()}
        # Every spooled sample arrived with its seq and original timestamp, in order.
        for m in spooled:
            assert got[m["seq"]]["data"]["sampled_at"] == m["data"]["sampled_at"]
        seqs = [f["seq"] for f in replayed()]
        assert seqs[: len(spooled)] == [m["seq"] for m in spooled]
        assert len(set(seqs)) == len(seqs)
        assert not (tmp_path / "state/spool.jsonl").read_text().strip()

        # Once acked, nothing is replayed on a later connection.
        await portal.stop()
        await portal.start()
        await await_until(lambda: [f for f in portal.of("metrics") if f["conn"] == 3])
        third = {f["seq"] for f in portal.frames if f["conn"] == 3}
        assert not third & {m["seq"] for m in spooled}


def envelope(seq: int, type_: str, **data: Any) -> str:
    return json.dumps({"type": type_, "v": 2, "seq": seq, "ts": 0.0, "data": data})


def test_spool_cap_drops_the_oldest_samples_never_lifecycle(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    sample = envelope(0, "metrics", sampled_at=0.0, gpus=[], pad="x" * 900)
    spool = Spool(path, max_bytes=10_000)
    seq = 0
    lifecycle = []
    for i in range(40):
        seq += 1
        if i % 10 == 0:
            spool.append(seq, envelope(seq, "job.started", attempt_id=i))
            lifecycle.append(seq)
        else:
            frame = sample.replace('"seq": 0', f'"seq": {seq}')
            assert spool.append(seq, frame, droppable=True)
    assert spool.bytes <= 10_000
    assert spool.dropped > 0
    kept = list(spool.droppable)
    assert kept == sorted(kept)
    assert kept[-1] == seq  # the newest sample is kept ...
    assert min(kept) > 20  # ... the oldest went first
    assert all(s in spool.entries for s in lifecycle)
    # Lifecycle frames are stored even past the cap; a sample that cannot fit is not.
    for _ in range(15):
        seq += 1
        spool.append(seq, envelope(seq, "job.exited", pad="y" * 900))
        lifecycle.append(seq)
    assert not spool.droppable
    seq += 1
    assert not spool.append(seq, sample, droppable=True)
    assert all(s in spool.entries for s in lifecycle)
    # The file says the same as memory, and acked frames stay gone after a reload.
    spool.remove(lifecycle[:3])
    again = Spool(path, max_bytes=10_000)
    assert list(again.entries) == lifecycle[3:]
    assert not (tmp_path / "spool.jsonl.acked").exists()


def test_acks_of_a_long_replay_do_not_rewrite_the_spool(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    spool = Spool(path)
    for seq in range(1, 2001):
        spool.append(seq, envelope(seq, "metrics", pad="z" * 500), droppable=True)
    inode = path.stat().st_ino
    for seq in range(1, 1001):
        spool.remove([seq])
    assert path.stat().st_ino == inode  # appended to .acked, no rewrite yet
    assert list(Spool(path).entries) == list(range(1001, 2001))
    for seq in range(1001, 2001):
        spool.remove([seq])
    assert path.read_text() == ""


async def test_cut_off_agent_stops_its_jobs_and_spools_the_exits(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state", kill_after_disconnect_s=0.5)
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        await portal.send(
            "job.launch", launch_data(13, "sleep 100", tmp_path, grace_s=1)
        )
        await await_until(lambda: portal.of("job.started", attempt_id=13))
        await asyncio.sleep(0.6)  # connected: nothing happens however long
        assert agent.jobs[13].outcome is None
        await portal.stop()
        down = time.monotonic()
        await await_until(lambda: agent.jobs[13].exit_seq is not None, 10)
        assert time.monotonic() - down >= 0.5
        spooled = [json.loads(f) for _, f in agent.spool.pending()]
        assert [m["type"] for m in spooled if m["type"] in DURABLE] == ["job.exited"]
        await portal.start()
        exited = (await await_until(lambda: portal.of("job.exited", attempt_id=13)))[0]
    assert exited["conn"] == 2
    assert exited["data"]["reason"] == "killed"
    assert exited["data"]["exit_code"] == 143
    assert exited["data"]["message"] == "agent cut off from the portal for 0.5 s"


async def test_tiny_spool_cap_keeps_the_exit_and_the_newest_samples(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(
        portal.url,
        tmp_path / "state",
        spool_metrics_interval_s=0.1,
        spool_max_bytes=8 * 1024,
    )
    gate = tmp_path / "gate"
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        await portal.send(
            "job.launch",
            launch_data(
                14, f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 5", tmp_path
            ),
        )
        [started] = await await_until(lambda: portal.of("job.started", attempt_id=14))
        await await_until(lambda: started["seq"] not in agent.spool.entries)  # acked
        await portal.stop()
        first = (await await_until(lambda: list(agent.spool.droppable)))[0]
        await await_until(lambda: agent.spool.dropped >= 10, 15)
        gate.touch()
        await await_until(lambda: agent.jobs[14].exit_seq is not None)
        await await_until(lambda: agent.spool.dropped >= 15, 15)
        assert agent.spool.bytes <= 8 * 1024
        kept = list(agent.spool.droppable)
        assert first not in kept
        await portal.start()
        exited = (await await_until(lambda: portal.of("job.exited", attempt_id=14)))[0]
        assert exited["data"]["exit_code"] == 5
        hello = portal.of("hello")[-1]
        replayed = [
            f["seq"]
            for f in portal.of("metrics")
            if f["conn"] == 2 and f["seq"] < hello["seq"]
        ]
        # Only the newest samples survived (the oldest were dropped first), in order;
        # the exit was never dropped.
        assert replayed == sorted(replayed)
        assert 1 <= len(replayed) < agent.spool.dropped
        assert min(replayed) >= kept[0] > first
        assert exited["conn"] == 2
