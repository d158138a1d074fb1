"""The agent against a loopback server playing the portal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
from agent_helpers import DURABLE, ROOT, Portal, await_until, launch_data

from agents.agent import Agent, Config
from agents.nvml import NvmlReader
from agents.simulate import SimNvml
from agents.spec import parse_node_spec

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = pytest.mark.anyio


def make_agent(url: str, state_dir: Path) -> Agent:
    sim = SimNvml(parse_node_spec("2xA100-80GB"), hostname="node-t")
    config = Config(
        server=url + "/ws/agent/",
        token="tok-123",
        state_dir=state_dir,
        heartbeat_s=0.2,
        sample_interval_s=0.1,
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
        reap_interval_s=0.05,
        allow_root_jobs=True,
        hostname="node-t",
    )
    return Agent(config, NvmlReader(sim), sim)


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.shutdown.set()
        await asyncio.wait_for(task, 5)


async def test_hello_launch_log_exit_and_never_started(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        hello = (await await_until(lambda: portal.of("hello")))[0]
        assert portal.headers == ["Bearer tok-123"]
        assert portal.extensions == [None]  # no permessage-deflate offered
        assert portal.paths == ["/ws/agent/"]
        assert hello["data"]["hostname"] == "node-t"
        assert len(hello["data"]["gpus"]) == 2
        uuid0 = hello["data"]["gpus"][0]["uuid"]

        await portal.send(
            "job.launch",
            launch_data(
                5,
                "echo hello; sleep 0.5; printf 'caf\\303\\251\\n'; exit 3",
                tmp_path,
                gpu_uuids=[uuid0],
                env={"GPULAB_SIM_UTIL": "75", "GPULAB_SIM_MEM_MIB": "5000"},
            ),
        )
        started = (await await_until(lambda: portal.of("job.started", attempt_id=5)))[0]
        pid = started["data"]["pid"]
        # It names no run_as and the agent has no --default-account: it runs as
        # the agent's own account, which job.started reports.
        assert started["data"]["run_as"] == pwd.getpwuid(os.geteuid()).pw_name

        # While it runs, metrics show the job's process on GPU 0, owned by it.
        def busy() -> Any:
            for m in portal.of("metrics"):
                g0 = m["data"]["gpus"][0]
                if g0["processes"] and g0["util_gpu"] == 75:
                    return g0
            return None

        g0 = await await_until(busy)
        assert g0["processes"] == [
            {"pid": pid, "used_memory_mib": 5000, "sm_util": 75.0, "attempt_id": 5}
        ]
        assert g0["memory_used_mib"] >= 5000

        exited = (await await_until(lambda: portal.of("job.exited", attempt_id=5)))[0]
        assert exited["data"]["exit_code"] == 3
        assert exited["data"]["reason"] == "exited"
        logs = portal.of("job.log", attempt_id=5)
        assert "".join(f["data"]["data"] for f in logs) == "hello\ncafé\n"
        assert logs[0]["data"]["offset"] == 0
        assert max(f["seq"] for f in logs) < exited["seq"]
        assert started["seq"] < logs[0]["seq"]

        # Acked exit: the job directory is removed.
        await await_until(lambda: not (tmp_path / "state/jobs/5").exists())

        # A repeated launch of a finished attempt re-sends the exit, runs nothing.
        await portal.send("job.launch", launch_data(5, "exit 9", tmp_path))
        await await_until(lambda: len(portal.of("job.exited", attempt_id=5)) == 2)
        assert portal.of("job.exited", attempt_id=5)[1]["data"]["exit_code"] == 3
        assert len(portal.of("job.started", attempt_id=5)) == 1

        await portal.send(
            "job.kill", {"attempt_id": 77, "job_id": 1077, "reason": "cancelled"}
        )
        never = (await await_until(lambda: portal.of("job.exited", attempt_id=77)))[0]
        assert never["data"]["reason"] == "never_started"
        assert never["data"]["exit_code"] is None

        # Heartbeats flow; a malformed server frame is logged, not fatal.
        await await_until(lambda: portal.of("heartbeat"))
        assert portal.conn is not None
        await portal.conn.send('{"type": "job.launch", "v": 2}')
        n = len(portal.frames)
        await await_until(lambda: len(portal.frames) > n + 2)
        assert portal.connections == 1

    seqs = [f["seq"] for f in portal.frames]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)


async def test_reconnect_replays_unacked_durable_frames_in_order(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        portal.acking = False  # nothing durable is acked on this connection
        gate = tmp_path / "gate"
        await portal.send(
            "job.launch",
            launch_data(
                6,
                f"echo before; while [ ! -e {gate} ]; do sleep 0.05; done;"
                " echo after; exit 4",
                tmp_path,
            ),
        )
        first_started = (
            await await_until(lambda: portal.of("job.started", attempt_id=6))
        )[0]
        await await_until(lambda: portal.of("job.log", attempt_id=6))

        # The portal goes away mid-job; the job ends while it is down.
        await portal.stop()
        gate.touch()
        await await_until(lambda: agent.jobs[6].exit_seq is not None)
        assert len(agent.spool.entries) >= 3
        portal.acking = True
        await portal.start()  # same port

        exited = (await await_until(lambda: portal.of("job.exited", attempt_id=6)))[0]
        assert exited["data"]["exit_code"] == 4
        assert exited["conn"] == 2
        second = [f for f in portal.frames if f["conn"] == 2]
        assert second[0]["type"] == "hello"
        replay = [f for f in second if f["type"] in DURABLE]
        # The unacked job.started comes again, with its seq, then the rest in order.
        assert replay[0]["seq"] == first_started["seq"]
        assert [f["seq"] for f in replay] == sorted(f["seq"] for f in replay)
        text = "".join(f["data"]["data"] for f in replay if f["type"] == "job.log")
        assert text == "before\nafter\n"
        await await_until(lambda: not agent.spool.entries)
        await await_until(lambda: not (tmp_path / "state/jobs/6").exists())

        # Once acked, nothing is sent again on a later connection.
        acked = {f["seq"] for f in second if f["type"] in DURABLE}
        await portal.stop()
        await portal.start()

        def third_metrics() -> list[dict[str, Any]]:
            return [f for f in portal.of("metrics") if f["conn"] == 3]

        await await_until(third_metrics)
        third = [f for f in portal.frames if f["conn"] == 3]
        assert not acked & {f["seq"] for f in third}
        assert not [f for f in third if f["type"] in DURABLE]
        assert min(f["seq"] for f in third) > max(acked)


async def test_token_rejection_is_logged_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from websockets.asyncio.server import ServerConnection, serve

    tries = 0

    async def reject(ws: ServerConnection) -> None:
        nonlocal tries
        tries += 1
        await ws.close(4401, "bad token")

    async with serve(reject, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        agent = make_agent(f"ws://127.0.0.1:{port}", tmp_path / "state")
        async with running(agent):
            await await_until(lambda: tries >= 2)
    assert "server rejected the token" in caplog.text
    assert "tok-123" not in caplog.text


def spawn_agent(url: str, state_dir: Path, token_file: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents",
            "--server",
            url,
            "--token-file",
            str(token_file),
            "--simulate",
            "1xA100-80GB",
            "--state-dir",
            str(state_dir),
            "--sample-interval",
            "0.2",
            "--backoff-base",
            "0.05",
            "--backoff-cap",
            "0.2",
            "--allow-root-jobs",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=(state_dir.parent / "agent.log").open("ab"),
    )


async def test_agent_killed_mid_job_adopts_it_after_restart(
    portal: Portal, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("tok-9\n")
    state = tmp_path / "state"
    gate = tmp_path / "gate"
    first = spawn_agent(portal.url, state, token)
    try:
        await await_until(lambda: portal.of("hello"), timeout=15)
        await portal.send(
            "job.launch",
            launch_data(
                8,
                f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 7",
                tmp_path,
            ),
        )
        await await_until(lambda: portal.of("job.started", attempt_id=8))
        first.send_signal(signal.SIGKILL)
        first.wait(5)
    finally:
        if first.poll() is None:
            first.kill()
    second = spawn_agent(portal.url, state, token)
    try:
        hellos = await await_until(
            lambda: len(portal.of("hello")) == 2 and portal.of("hello")
        )
        running_jobs = hellos[1]["data"]["running"]
        assert [r["attempt_id"] for r in running_jobs] == [8]
        assert hellos[0]["data"]["incarnation"] != hellos[1]["data"]["incarnation"]
        gate.touch()
        exited = (await await_until(lambda: portal.of("job.exited", attempt_id=8)))[0]
        assert exited["data"]["exit_code"] == 7
        assert exited["data"]["reason"] == "exited"
        # seq persisted across the restart: a seq seen twice is only ever a replay
        # of the same unacked durable frame, never a new frame reusing a number.
        by_seq: dict[int, tuple[str, Any]] = {}
        for f in portal.frames:
            frame = (f["type"], f["data"])
            assert by_seq.setdefault(f["seq"], frame) == frame
            if by_seq[f["seq"]] is not frame:
                assert f["type"] in DURABLE

        # SIGTERM: clean exit 0, promptly.
        second.send_signal(signal.SIGTERM)
        assert second.wait(5) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    log = (tmp_path / "agent.log").read_text()
    assert "tok-9" not in log


async def test_restart_reports_a_vanished_shim_as_lost(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        portal.acking = False
        await portal.send("job.launch", launch_data(9, "sleep 1000", tmp_path))
        await await_until(lambda: portal.of("job.started", attempt_id=9))
    # The agent is down; the shim dies without writing exit_code (e.g. OOM killer).
    job_dir = tmp_path / "state/jobs/9"
    shim_pid = int((job_dir / "shim.pid").read_text().split()[0])
    pgid = int((job_dir / "pgid").read_text())
    os.kill(shim_pid, signal.SIGKILL)
    os.killpg(pgid, signal.SIGKILL)
    portal.acking = True
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        exited = (await await_until(lambda: portal.of("job.exited", attempt_id=9)))[0]
        assert exited["data"]["reason"] == "lost"
        assert exited["data"]["exit_code"] is None
        # The job.started left unacked by the first run is replayed, not re-created.
        assert len({f["seq"] for f in portal.of("job.started", attempt_id=9)}) == 1


def test_spool_file_is_json_lines(tmp_path: Path) -> None:
    from agents.spool import SeqCounter, Spool

    spool = Spool(tmp_path / "spool.jsonl")
    spool.append(5, json.dumps({"seq": 5, "type": "job.log"}))
    spool.append(6, json.dumps({"seq": 6, "type": "job.log"}))
    with (tmp_path / "spool.jsonl").open("a") as fh:
        fh.write('{"seq": 7, "ty')  # torn by a crash
    again = Spool(tmp_path / "spool.jsonl")
    assert list(again.entries) == [5, 6]
    again.remove([5])
    assert list(Spool(tmp_path / "spool.jsonl").entries) == [6]
    counter = SeqCounter(tmp_path / "agent.json")
    first = [counter.take() for _ in range(3)]
    assert first == [1, 2, 3]
    assert SeqCounter(tmp_path / "agent.json").take() > 3


def test_log_chunks_never_split_a_utf8_character(tmp_path: Path) -> None:
    from agents.launcher import Job

    agent = make_agent("ws://127.0.0.1:9", tmp_path / "state")
    job_dir = tmp_path / "state/jobs/3"
    job_dir.mkdir(parents=True)
    # "é" (2 bytes) straddles the 64 KiB chunk boundary.
    raw = b"a" * (64 * 1024 - 1) + "é".encode() + "z€".encode()
    (job_dir / "output.log").write_bytes(raw)
    job = Job(3, 1003, job_dir, [], {})
    agent._ship_log(job, final=False)
    agent._ship_log(job, final=False)
    chunks = [json.loads(f)["data"] for _, f in agent.spool.pending()]
    assert [c["offset"] for c in chunks] == [0, 64 * 1024 - 1]
    assert chunks[0]["data"] == "a" * (64 * 1024 - 1)
    assert chunks[1]["data"] == "éz€"
    assert "\ufffd" not in "".join(c["data"] for c in chunks)
    # A character still being written is held back until it is complete.
    with (job_dir / "output.log").open("ab") as fh:
        fh.write("€".encode()[:2])
    agent._ship_log(job, final=False)
    assert len(agent.spool.pending()) == 2
    with (job_dir / "output.log").open("ab") as fh:
        fh.write("€".encode()[2:])
    agent._ship_log(job, final=True)
    last = json.loads(agent.spool.pending()[-1][1])["data"]
    assert (last["offset"], last["data"]) == (len(raw), "€")


def test_no_log_ships_before_the_start_is_reported(tmp_path: Path) -> None:
    """The command writes output.log before its shim writes ``pgid``: the reaper
    holds the output back until job.started is spooled, so it comes first."""
    from agents.launcher import Job
    from agents.statedir import proc_start_time

    agent = make_agent("ws://127.0.0.1:9", tmp_path / "state")
    job_dir = tmp_path / "state/jobs/4"
    job_dir.mkdir(parents=True)
    (job_dir / "output.log").write_bytes(b"early\n")
    # A live "shim" (this process) that has not written pgid yet.
    me = os.getpid()
    job = Job(4, 1004, job_dir, [], {}, shim_pid=me, shim_start=proc_start_time(me))
    agent._reap(job)
    assert agent.spool.pending() == []

    (job_dir / "pgid").write_text(f"{me}\n")
    agent._reap(job)
    types = [json.loads(f)["type"] for _, f in agent.spool.pending()]
    assert types == ["job.started", "job.log"]
