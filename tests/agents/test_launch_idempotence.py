"""Repeated launches (the portal re-sends a launch it got no start for) and the
rank-0 rendezvous port check, against a loopback server playing the portal."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import pytest
from agent_helpers import Portal, await_until, launch_data, make_agent, running

from agents import protocol
from agents.rendezvous import port_busy, rank0_rendezvous

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.anyio


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something really listens on (on every address), as a leftover
    rendezvous of another job would."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, port: int, master: str = "localhost") -> dict[str, str]:
    """What the portal's ``rank_env`` gives a rank of a 2-node job."""
    values = {
        "NNODES": "2",
        "NODE_RANK": str(rank),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "NPROC_PER_NODE": "1",
    }
    env = {f"GPULAB_{k}": v for k, v in values.items()}
    env.update({f"PET_{k}": v for k, v in values.items()})
    env.update({"MASTER_ADDR": master, "MASTER_PORT": str(port)})
    return env


# ------------------------------------------------------------------ the port check


def test_a_port_with_a_listener_is_busy_and_a_closed_one_is_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]

        problem = port_busy("localhost", port)

        assert problem is not None
        assert f"rendezvous port {port} busy" in problem
    assert port_busy("localhost", port) is None


def test_a_master_name_that_does_not_resolve_still_checks_the_port(
    busy_port: int,
) -> None:
    assert port_busy("no-such-host.invalid", busy_port) is not None
    assert port_busy("no-such-host.invalid", free_port()) is None


def test_only_rank_0_of_a_job_spanning_nodes_checks_a_port() -> None:
    assert rank0_rendezvous(rank_env(0, 29517, "node-a")) == ("node-a", 29517)
    assert rank0_rendezvous(rank_env(1, 29517)) is None
    assert rank0_rendezvous({}) is None  # a single-node job
    assert rank0_rendezvous({**rank_env(0, 29517), "GPULAB_NNODES": "1"}) is None
    assert rank0_rendezvous({**rank_env(0, 29517), "GPULAB_MASTER_PORT": "x"}) is None


def test_port_busy_is_a_valid_exit_and_old_reasons_still_are() -> None:
    for reason in ("exited", "killed", "launch_failed", "port_busy"):
        frame = protocol.JobExited(
            seq=1,
            ts=1.0,
            data=protocol.JobExitedData(
                attempt_id=1, job_id=2, exit_code=None, ended_at=1.0, reason=reason
            ),
        ).model_dump_json()
        assert protocol.parse_agent_message(frame).data.reason == reason  # type: ignore[union-attr]


# ------------------------------------------------------------------ the agent


async def test_rank_0_with_its_port_busy_is_not_launched_and_says_why(
    portal: Portal, tmp_path: Path, busy_port: int
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    marker = tmp_path / "ran"
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        launch = launch_data(
            21, f"touch {marker}", tmp_path, env=rank_env(0, busy_port)
        )

        await portal.send("job.launch", launch)

        [exited] = await await_until(lambda: portal.of("job.exited", attempt_id=21))
        assert exited["data"]["reason"] == "port_busy"
        assert exited["data"]["exit_code"] is None
        assert f"rendezvous port {busy_port} busy" in exited["data"]["message"]
        assert not portal.of("job.started", attempt_id=21)
        # Acked: the job directory goes. A repeated launch re-sends the same
        # answer and still runs nothing, even though it may find the port free now.
        await await_until(lambda: not (tmp_path / "state/jobs/21").exists())
        await portal.send("job.launch", launch)
        await await_until(lambda: len(portal.of("job.exited", attempt_id=21)) == 2)
        assert portal.of("job.exited", attempt_id=21)[1]["data"]["reason"] == (
            "port_busy"
        )

        # Another rank of a job with that port is not the one that listens: it runs.
        await portal.send(
            "job.launch",
            launch_data(22, f"touch {marker}", tmp_path, env=rank_env(1, busy_port)),
        )
        [other] = await await_until(lambda: portal.of("job.exited", attempt_id=22))
        assert (other["data"]["reason"], other["data"]["exit_code"]) == ("exited", 0)
        assert portal.of("job.started", attempt_id=22)

        # Rank 0 with a free port runs.
        await portal.send(
            "job.launch",
            launch_data(23, "exit 0", tmp_path, env=rank_env(0, free_port())),
        )
        [ok] = await await_until(lambda: portal.of("job.exited", attempt_id=23))
        assert ok["data"]["reason"] == "exited"
    assert not portal.of("job.started", attempt_id=21)
    assert len(portal.of("job.started", attempt_id=22)) == 1


async def test_a_refused_rank_0_is_reported_again_after_an_agent_restart(
    portal: Portal, tmp_path: Path, busy_port: int
) -> None:
    """The refusal is in the job directory: an agent restarted before the portal
    acked it reports it again and never launches the attempt."""
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        portal.acking = False
        launch = launch_data(24, "exit 0", tmp_path, env=rank_env(0, busy_port))
        await portal.send("job.launch", launch)
        await await_until(lambda: portal.of("job.exited", attempt_id=24))
    portal.acking = True
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: len(portal.of("hello")) == 2)
        await portal.send("job.launch", launch)
        await await_until(lambda: not (tmp_path / "state/jobs/24").exists())
    reasons = {f["data"]["reason"] for f in portal.of("job.exited", attempt_id=24)}
    assert reasons == {"port_busy"}
    assert not portal.of("job.started", attempt_id=24)


async def test_a_repeated_launch_of_a_running_attempt_starts_nothing_new(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    gate = tmp_path / "gate"
    command = f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 5"
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        await portal.send("job.launch", launch_data(31, command, tmp_path))
        [first] = await await_until(lambda: portal.of("job.started", attempt_id=31))
        shim = (tmp_path / "state/jobs/31/shim.pid").read_text()

        await portal.send("job.launch", launch_data(31, command, tmp_path))

        # The answer to the repeat is the start again (same process), not a new one.
        starts = await await_until(
            lambda: (
                len(portal.of("job.started", attempt_id=31)) == 2
                and portal.of("job.started", attempt_id=31)
            )
        )
        assert starts[1]["data"]["pid"] == first["data"]["pid"]
        assert starts[1]["data"]["started_at"] == first["data"]["started_at"]
        assert (tmp_path / "state/jobs/31/shim.pid").read_text() == shim
        assert [j.attempt_id for j in agent.running()] == [31]
        gate.touch()
        [exited] = await await_until(lambda: portal.of("job.exited", attempt_id=31))
        assert exited["data"]["exit_code"] == 5
        await await_until(lambda: not (tmp_path / "state/jobs/31").exists())

        # After the acked exit, another repeat re-sends the exit and runs nothing.
        await portal.send("job.launch", launch_data(31, command, tmp_path))
        await await_until(lambda: len(portal.of("job.exited", attempt_id=31)) == 2)
    assert len(portal.of("job.started", attempt_id=31)) == 2
    assert not (tmp_path / "state/jobs/31").exists()


async def test_a_repeated_launch_after_an_agent_restart_adopts_the_running_job(
    portal: Portal, tmp_path: Path
) -> None:
    """The job directory is the registry: a restarted agent knows the attempt, so a
    launch re-sent by the portal does not start it a second time."""
    gate = tmp_path / "gate"
    command = f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 6"
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        await portal.send("job.launch", launch_data(32, command, tmp_path))
        [first] = await await_until(lambda: portal.of("job.started", attempt_id=32))
    shim = (tmp_path / "state/jobs/32/shim.pid").read_text()
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        hellos = await await_until(
            lambda: len(portal.of("hello")) == 2 and portal.of("hello")
        )
        assert [r["attempt_id"] for r in hellos[1]["data"]["running"]] == [32]

        await portal.send("job.launch", launch_data(32, command, tmp_path))

        starts = await await_until(
            lambda: (
                len(portal.of("job.started", attempt_id=32)) == 2
                and portal.of("job.started", attempt_id=32)
            )
        )
        assert starts[1]["data"]["pid"] == first["data"]["pid"]
        assert (tmp_path / "state/jobs/32/shim.pid").read_text() == shim
        gate.touch()
        [exited] = await await_until(lambda: portal.of("job.exited", attempt_id=32))
        assert exited["data"]["exit_code"] == 6
