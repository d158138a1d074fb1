"""Several web processes on one port (``WEB_CONCURRENCY``, uvicorn's own variable;
README "Load and scale"): agents' sockets, the API and the pages land on any of
them, and a job still goes from the form to its node and back.

Every per-process piece (the metrics writer, the concurrency gate, the live
aggregator's Hub) is shared through PostgreSQL or Redis; this runs it for real,
with the two nodes' agents held by different processes (read from the kernel's
socket tables), so each process serves an agent and a job."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import login, submit, wait_for_job, wait_until

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:  # closed meanwhile
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", target)
        if match:
            inodes.add(int(match.group(1)))
    return inodes


def _tcp_connections() -> list[tuple[int, int, int]]:
    """(local port, remote port, inode) of every established IPv4 TCP socket."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        if state == "01":  # ESTABLISHED
            out.append(
                (
                    int(local.split(":")[1], 16),
                    int(remote.split(":")[1], 16),
                    int(inode),
                )
            )
    return out


def serving_pid(agent_pid: int, port: int, workers: list[int]) -> int | None:
    """The web process that holds the server end of the agent's connection to
    ``port`` (None while it has none)."""
    connections = _tcp_connections()
    agent_sockets = _socket_inodes(agent_pid)
    agent_ports = {
        local for local, remote, inode in connections
        if remote == port and inode in agent_sockets
    }  # fmt: skip
    server_ends = {
        inode for local, remote, inode in connections
        if local == port and remote in agent_ports
    }  # fmt: skip
    holders = [pid for pid in workers if _socket_inodes(pid) & server_ends]
    return holders[0] if len(holders) == 1 else None


@pytest.mark.web_env(WEB_CONCURRENCY=2)
def test_jobs_run_through_two_web_processes(stack: Stack, alice: User) -> None:
    from scheduler import services
    from scheduler.models import Allocation, Gpu, Job, Node

    web = stack.procs["web"]
    started = [web.wait_for(r"Started server process \[(\d+)\]")]
    started.append(
        web.wait_for(
            r"Started server process \[(\d+)\]", start=web.lines.index(started[0]) + 1
        )
    )
    workers = [int(re.findall(r"\[(\d+)\]", line)[0]) for line in started]
    assert len(set(workers)) == 2  # two processes, each its own pid

    def connect(name: str, token: str) -> int:
        """Start the node's agent; the pid of the web process its socket is on."""
        mark = len(web.lines)
        agent = stack.start_agent(name, token, "2xA100-80GB")
        web.wait_for(rf"agent of node {name} connected", start=mark)
        pid: int = wait_until(
            lambda: serving_pid(agent.popen.pid, stack.port, workers),
            what=f"the web process holding {name}'s socket",
        )
        return pid

    nodes, tokens, served_by = [], {}, []
    for name in ("wp-a", "wp-b"):
        node, tokens[name] = services.create_node(name)
        nodes.append(node.pk)
        served_by.append(connect(name, tokens[name]))
    if served_by[1] == served_by[0]:
        # The kernel handed both connections to one process (which one accepts is
        # not up to us): with that one stopped, only the other can accept wp-b's
        # next connection.
        holder = served_by[0]
        stack.procs["agent-wp-b"].stop()
        os.kill(holder, signal.SIGSTOP)
        try:
            served_by[1] = connect("wp-b", tokens["wp-b"])
        finally:
            os.kill(holder, signal.SIGCONT)
    assert sorted(served_by) == sorted(workers)
    wait_until(
        lambda: Node.objects.filter(pk__in=nodes, status="up").count() == 2,
        what="both nodes' hellos",
    )

    # Two jobs of two GPUs each, running at once on two nodes of two GPUs: one
    # on each node, so each process sends a launch and relays its node's reports.
    client = login(stack.base_url, "alice", "pw-alice")
    marker = stack.tmp / "web-processes-finish"
    wait = f"while [ ! -e {marker} ]; do sleep 0.1; done; echo done"
    jobs = [submit(client, f"through-{i}", wait, gpus="2") for i in range(2)]
    for job_id in jobs:
        assert wait_for_job(job_id, {"running"}) == "running"
    ran_on = sorted(
        Allocation.objects.filter(attempt__job_id__in=jobs)
        .values_list("gpu__node_id", flat=True)
        .distinct()
    )
    assert ran_on == sorted(nodes)
    marker.touch()
    for job_id in jobs:
        assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"
    # every GPU's latest state arrived, through whichever process holds its socket
    wait_until(
        lambda: not Gpu.objects.filter(node_id__in=nodes, latest_at=None).exists(),
        what="every GPU's latest state",
    )
