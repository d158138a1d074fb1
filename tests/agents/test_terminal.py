"""Terminals of interactive jobs (``agents.terminal``): real PTYs and real shells
started by an in-process agent as a non-root account, driven by ``terminal.*``
frames from a loopback portal, as the real portal sends them."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import signal
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from agent_helpers import Portal, await_until, launch_data, make_agent, running

from agents.terminal import session_members

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="switches to a test account: root"),
]


@pytest.fixture
def account() -> Iterator[pwd.struct_passwd]:
    """A new non-root account with bash as its shell; its processes (the jobs
    the agent leaves running when it stops, by design) are killed at the end."""
    name = f"gpulabterm{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", name],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(name)
    try:
        yield entry
    finally:
        for status in Path("/proc").glob("[0-9]*/status"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                uid_line = next(
                    ln for ln in status.read_text().splitlines() if ln[:4] == "Uid:"
                )
                if int(uid_line.split()[1]) == entry.pw_uid:
                    os.kill(int(status.parent.name), signal.SIGKILL)
        subprocess.run(["userdel", name], check=False, capture_output=True)


def tid() -> str:
    return uuid.uuid4().hex


def output(portal: Portal, terminal_id: str) -> str:
    return "".join(
        f["data"]["data"] for f in portal.of("terminal.output", terminal_id=terminal_id)
    )


async def start_job(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd, attempt: int
) -> dict[str, Any]:
    """A running interactive-style job (it waits until killed) as ``account``."""
    workdir = tmp_path / "work"
    workdir.mkdir(mode=0o777, exist_ok=True)
    data = launch_data(
        attempt,
        "sleep 3600",
        workdir,
        run_as=account.pw_name,
        env={"GPULAB_TEST_VAR": "from-the-job"},
        gpu_uuids=["GPU-aaaa"],
    )
    await portal.send("job.launch", data)
    await await_until(lambda: portal.of("job.started", attempt_id=attempt))
    return data


async def open_terminal(
    portal: Portal, job: dict[str, Any], terminal_id: str, **extra: Any
) -> None:
    await portal.send(
        "terminal.open",
        {
            "terminal_id": terminal_id,
            "attempt_id": job["attempt_id"],
            "job_id": job["job_id"],
            "cols": 100,
            "rows": 30,
            **extra,
        },
    )


async def type_(portal: Portal, terminal_id: str, text: str) -> None:
    await portal.send("terminal.input", {"terminal_id": terminal_id, "data": text})


async def test_a_terminal_runs_the_login_shell_as_the_jobs_account(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        job = await start_job(portal, tmp_path, account, 41)
        term = tid()
        await open_terminal(portal, job, term)
        await type_(
            portal,
            term,
            'echo "who=$(id -u) dir=$PWD var=$GPULAB_TEST_VAR'
            ' gpu=$CUDA_VISIBLE_DEVICES size=$(stty size) tty=$(tty)"\r',
        )
        line = await await_until(
            lambda: [
                ln for ln in output(portal, term).splitlines() if ln.startswith("who=")
            ]
        )
        assert line[0].split() == [
            f"who={account.pw_uid}",
            f"dir={tmp_path / 'work'}",
            "var=from-the-job",
            "gpu=GPU-aaaa",
            "size=30",
            "100",
            line[0].split()[-1],
        ]
        assert line[0].split()[-1].startswith("tty=/dev/pts/")
        # Its processes count as the job's in the GPU samples.
        assert agent._owner_lookup()(agent.terminals.by_id[term].pid) == 41

        # A resize reaches the PTY.
        await portal.send(
            "terminal.resize", {"terminal_id": term, "cols": 132, "rows": 50}
        )
        await type_(portal, term, 'echo "now=$(stty size)"\r')
        await await_until(lambda: "now=50 132" in output(portal, term))

        # The shell's exit status is the terminal's.
        await type_(portal, term, "exit 7\r")
        [exited] = await await_until(
            lambda: portal.of("terminal.exit", terminal_id=term)
        )
        assert exited["data"] == {
            "terminal_id": term,
            "job_id": job["job_id"],
            "code": 7,
            "message": "",
        }
        assert term not in agent.terminals.by_id


@pytest.fixture(params=["default", "ignored"])
def agent_signals(request: pytest.FixtureRequest) -> Iterator[None]:
    """The agent's own SIGINT and SIGQUIT: as a service gets them, or ignored, as
    ``nohup`` or a background start leaves them (inherited by what it spawns
    unless it resets them)."""
    if request.param == "default":
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@pytest.mark.usefixtures("agent_signals")
async def test_ctrl_c_interrupts_the_foreground_command_not_the_shell(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        job = await start_job(portal, tmp_path, account, 42)
        term = tid()
        await open_terminal(portal, job, term)
        await type_(portal, term, "echo started-$((1+1)); sleep 600\r")
        await await_until(lambda: "started-2" in output(portal, term))
        shell = agent.terminals.by_id[term].pid
        # The sleep is in the terminal's session, in a group of its own.
        sleeper = await await_until(
            lambda: [p for p in session_members(shell) if os.getpgid(p) != shell]
        )
        await type_(portal, term, "\x03")
        await type_(portal, term, "echo after=$?\r")
        # SIGINT's status (130), printed by the shell that survived it.
        await await_until(lambda: "after=130" in output(portal, term))
        assert not any(Path(f"/proc/{p}").exists() for p in sleeper)
        assert Path(f"/proc/{shell}").exists()
        await type_(portal, term, "exit\r")
        [exited] = await await_until(
            lambda: portal.of("terminal.exit", terminal_id=term)
        )
        assert exited["data"]["code"] == 0


async def test_one_command_returns_its_exit_code(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        job = await start_job(portal, tmp_path, account, 43)
        term = tid()
        await open_terminal(portal, job, term, command="echo one-shot; exit 3")
        [exited] = await await_until(
            lambda: portal.of("terminal.exit", terminal_id=term)
        )
        assert exited["data"]["code"] == 3
        assert "one-shot" in output(portal, term)


async def test_the_jobs_end_hangs_up_its_terminals(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        job = await start_job(portal, tmp_path, account, 44)
        terms = [tid(), tid()]
        for term in terms:
            await open_terminal(portal, job, term)
        # A command that ignores SIGHUP still goes (SIGKILL after the grace).
        await type_(portal, terms[0], "trap '' HUP; echo ready-$((1+1)); sleep 600\r")
        await await_until(lambda: "ready-2" in output(portal, terms[0]))
        shells = [agent.terminals.by_id[t].pid for t in terms]
        members = [p for s in shells for p in session_members(s)]
        assert len(members) >= 3
        await portal.send(
            "job.kill",
            {"attempt_id": 44, "job_id": job["job_id"], "reason": "cancelled"},
        )
        for term in terms:
            [exited] = await await_until(
                lambda t=term: portal.of("terminal.exit", terminal_id=t), timeout=15
            )
            assert exited["data"]["code"] is None
            assert "hung up: the job was cancelled" in exited["data"]["message"]
        # SIGKILLed: gone at once (the kernel needs a moment to finish them).
        await await_until(lambda: not [p for s in shells for p in session_members(s)])
        await await_until(lambda: portal.of("job.exited", attempt_id=44))
        # A terminal for a job that ended is refused, saying why.
        late = tid()
        await open_terminal(portal, job, late)
        [refused] = await await_until(
            lambda: portal.of("terminal.exit", terminal_id=late)
        )
        assert refused["data"]["message"] == "the job is not running on this node"


async def test_attaching_again_replays_the_scrollback_and_continues(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd
) -> None:
    agent = make_agent(portal.url, tmp_path / "state", terminal_linger_s=60)
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        job = await start_job(portal, tmp_path, account, 45)
        term = tid()
        await open_terminal(portal, job, term)
        await type_(portal, term, "X=kept-in-the-shell; echo before-$((2+3))\r")
        await await_until(lambda: "before-5" in output(portal, term))
        await portal.send("terminal.close", {"terminal_id": term, "detach": True})
        # Output while nobody watches goes to the scrollback only.
        await await_until(lambda: not agent.terminals.by_id[term].viewers)
        await type_(portal, term, "echo while-away-$((3+4))\r")
        await await_until(
            lambda: b"while-away-7" in agent.terminals.by_id[term].scrollback
        )
        assert "while-away-7" not in output(portal, term)
        seen = len(portal.of("terminal.output", terminal_id=term))

        await open_terminal(portal, job, term)
        [replay] = await await_until(
            lambda: [
                f
                for f in portal.of("terminal.output", terminal_id=term)[seen:]
                if f["data"]["replay"]
            ]
        )
        assert "before-5" in replay["data"]["data"]
        assert "while-away-7" in replay["data"]["data"]
        # The same shell: its variable is still set.
        await type_(portal, term, 'echo "x=$X"\r')
        await await_until(lambda: "x=kept-in-the-shell" in output(portal, term))


async def test_a_detached_terminal_is_hung_up_after_its_linger(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd
) -> None:
    agent = make_agent(portal.url, tmp_path / "state", terminal_linger_s=0.3)
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        job = await start_job(portal, tmp_path, account, 46)
        term = tid()
        await open_terminal(portal, job, term)
        await await_until(lambda: output(portal, term))
        shell = agent.terminals.by_id[term].pid
        await portal.send("terminal.close", {"terminal_id": term, "detach": True})
        [exited] = await await_until(
            lambda: portal.of("terminal.exit", terminal_id=term)
        )
        assert exited["data"]["message"] == "terminal hung up: no viewer for 0.3 s"
        await await_until(lambda: not session_members(shell))
        # The job itself runs on.
        assert [j.attempt_id for j in agent.running()] == [46]


async def test_bad_terminal_frames_are_refused_and_change_nothing(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        # An attempt this agent does not hold.
        term = tid()
        await portal.send(
            "terminal.open", {"terminal_id": term, "attempt_id": 99, "job_id": 5}
        )
        [exited] = await await_until(
            lambda: portal.of("terminal.exit", terminal_id=term)
        )
        assert exited["data"]["message"] == "the job is not running on this node"
        # Input for no terminal is ignored; the agent goes on.
        await type_(portal, tid(), "echo nothing\r")
        assert agent.terminals.by_id == {}


async def test_output_the_link_cannot_take_is_bounded_and_marked(
    portal: Portal, tmp_path: Path, account: pwd.struct_passwd
) -> None:
    from agents.terminal import PENDING_MAX

    agent = make_agent(portal.url, tmp_path / "state")
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        job = await start_job(portal, tmp_path, account, 47)
        term = tid()
        await open_terminal(portal, job, term)
        await await_until(lambda: output(portal, term))
        # The link is congested: nothing goes out, the output waits (bounded).
        send = agent.terminals.send
        agent.terminals.send = lambda cls, data: False
        seen = len(portal.of("terminal.output", terminal_id=term))
        await type_(
            portal, term, "head -c 700000 /dev/zero | tr '\\0' x; echo end-$((1+1))\r"
        )
        await await_until(
            lambda: b"end-2" in agent.terminals.by_id[term].scrollback, timeout=30
        )
        assert len(agent.terminals.by_id[term].pending) <= PENDING_MAX
        agent.terminals.send = send
        await await_until(lambda: "end-2" in output(portal, term), timeout=30)
        after = "".join(
            f["data"]["data"]
            for f in portal.of("terminal.output", terminal_id=term)[seen:]
        )
        skipped = re.search(r"\[gpulab: (\d+) bytes of output skipped\]", after)
        assert skipped is not None
        assert int(skipped.group(1)) >= 700_000 - PENDING_MAX
        assert len(after) < PENDING_MAX + 1000
        assert "x" * 1000 in after  # what was kept is the newest output
