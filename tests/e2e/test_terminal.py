"""Terminals of interactive jobs end to end (docs/terminals.md): the real stack
(uvicorn, a Celery worker, a simulated agent), a shell in a real PTY started by
the agent as a non-root account, reached over the portal's websocket by a
websocket client, by ``gpulab shell`` in a real pseudo-terminal (pexpect), and
by xterm.js in Chromium; a web process restart re-attaches the same shell."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.browser import chromium, collect_errors, log_in
from tests.e2e.conftest import ROOT, Stack, login, submit, wait_for_job

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="creates a Unix account: root"),
]

GPULAB = str(Path(sys.executable).parent / "gpulab")


@pytest.fixture
def account(alice: User) -> Iterator[pwd.struct_passwd]:
    """A non-root Unix account with bash, alice's (her jobs run as it); its
    processes are killed at the end (the job's shim outlives the agent)."""
    from scheduler.models import Profile

    name = f"gpulabe2e{uuid.uuid4().hex[:6]}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", name],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(name)
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": name})
    try:
        yield entry
    finally:
        for status in Path("/proc").glob("[0-9]*/status"):
            with contextlib.suppress(OSError, ValueError, StopIteration):
                uid = next(
                    ln for ln in status.read_text().splitlines() if ln[:4] == "Uid:"
                )
                if int(uid.split()[1]) == entry.pw_uid:
                    os.kill(int(status.parent.name), signal.SIGKILL)
        subprocess.run(["userdel", name], check=False, capture_output=True)


def shell_job(stack: Stack, owner: User, tmp_path: Path) -> int:
    """A running interactive terminal job of ``owner`` on a new node."""
    from scheduler.services.jobs import interactive_request, submit_job

    stack.start_node(f"term-{uuid.uuid4().hex[:4]}", "1xA100-80GB", 1)
    work = tmp_path / "work"
    work.mkdir(mode=0o777, exist_ok=True)
    job = submit_job(owner, interactive_request("shell", workdir=str(work)))
    assert wait_for_job(job.pk, {"running", "failed"}) == "running"
    return job.pk


def token_of(user: User) -> str:
    from portal.api.tokens import create_token

    return create_token(user, f"t-{uuid.uuid4().hex[:6]}", None)[1]


def ws_url(stack: Stack, job_id: int) -> str:
    return f"ws://127.0.0.1:{stack.port}/ws/interactive/{job_id}/terminal/"


async def converse(
    url: str, headers: dict[str, str], first: dict[str, Any], keys: list[str]
) -> tuple[list[dict[str, Any]], int | None]:
    """Open, send ``keys`` once the terminal answered, read to the end; every
    message received, and the close code."""
    got: list[dict[str, Any]] = []
    async with connect(url, additional_headers=headers, open_timeout=30) as ws:
        with contextlib.suppress(ConnectionClosed):  # refused at once
            await ws.send(json.dumps(first))
        sent = False
        with contextlib.suppress(Exception):
            async with asyncio.timeout(60):
                async for raw in ws:
                    got.append(json.loads(raw))
                    if not sent and got[-1]["type"] == "output":
                        for key in keys:
                            await ws.send(json.dumps({"type": "input", "data": key}))
                        sent = True
        return got, ws.close_code


def text(messages: list[dict[str, Any]]) -> str:
    return "".join(m["data"] for m in messages if m["type"] == "output")


def test_the_owner_gets_a_shell_as_her_account_and_its_exit_status(
    stack: Stack, alice: User, bob: User, account: pwd.struct_passwd, tmp_path: Path
) -> None:
    job_id = shell_job(stack, alice, tmp_path)
    url = ws_url(stack, job_id)
    alice_auth = {"Authorization": f"Bearer {token_of(alice)}"}

    got, code = asyncio.run(
        converse(
            url,
            alice_auth,
            {"type": "open", "cols": 90, "rows": 20},
            [
                'echo "user=$(id -un) gpus=$CUDA_VISIBLE_DEVICES size=$(stty size)"\r',
                "exit 4\r",
            ],
        )
    )
    assert got[0]["type"] == "opened"
    out = text(got)
    assert f"user={account.pw_name} gpus=GPU-" in out
    assert "size=20 90" in out
    # The account the agent reported in job.started is that one (the job page's
    # terminal card names it).
    from scheduler.models import Attempt

    assert Attempt.objects.get(job_id=job_id).run_as == account.pw_name
    assert got[-1] == {"type": "exit", "code": 4, "message": ""}
    assert code == 1000

    # Bob (same lab group: he sees the job's page) gets nothing through the
    # socket: closed as for a job that does not exist, before any data.
    bob_auth = {"Authorization": f"Bearer {token_of(bob)}"}
    for headers in (bob_auth, {"Authorization": "Bearer gpl_nonsense"}):
        got, code = asyncio.run(converse(url, headers, {"type": "open"}, ["id\r"]))
        assert (got, code) == ([], 4404)
    got, code = asyncio.run(
        converse(ws_url(stack, 999_999), alice_auth, {"type": "open"}, [])
    )
    assert (got, code) == ([], 4404)
    # Another viewer's terminal id does not attach on this job either.
    got, code = asyncio.run(
        converse(url, alice_auth, {"type": "open", "terminal": "x" * 30}, [])
    )
    assert got[-1]["message"] == "no such terminal in this job"
    assert code == 4409


def test_a_batch_job_has_no_terminal(stack: Stack, alice: User) -> None:
    stack.start_node("term-batch", "1xA100-80GB", 1)
    client = login(stack.base_url, "alice", "pw-alice")
    job_id = submit(client, "batch", "sleep 600")
    wait_for_job(job_id, {"running"})
    got, code = asyncio.run(
        converse(
            ws_url(stack, job_id),
            {"Authorization": f"Bearer {token_of(alice)}"},
            {"type": "open"},
            [],
        )
    )
    assert got == [
        {
            "type": "exit",
            "code": None,
            "message": f"job {job_id} is not an interactive job",
        }
    ]
    assert code == 4409


def gpulab_env(stack: Stack, alice: User, tmp_path: Path) -> dict[str, str]:
    """``gpulab`` logged in as alice with a token (this checkout's code)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO", "DATABASE", "REDIS", "GPULAB"))
    }
    env.update(
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        PYTHONPATH=str(ROOT),
        GPULAB_SERVER=stack.base_url,
        GPULAB_TOKEN=token_of(alice),
        TERM="xterm",
    )
    return env


def test_gpulab_shell_runs_one_command_and_returns_its_status(
    stack: Stack, alice: User, account: pwd.struct_passwd, tmp_path: Path
) -> None:
    import pexpect

    from scheduler.models import Job

    # No --job: the CLI submits the interactive job itself, and cancels it
    # when the command is done (its GPU is freed).
    stack.start_node(f"term-{uuid.uuid4().hex[:4]}", "1xA100-80GB", 1)
    work = tmp_path / "work"
    work.mkdir(mode=0o777, exist_ok=True)
    child = pexpect.spawn(
        GPULAB,
        [
            "shell",
            "--workdir",
            str(work),
            "-c",
            "echo ran-as-$(id -un) in $PWD; exit 3",
        ],
        env=gpulab_env(stack, alice, tmp_path),
        timeout=60,
        encoding="utf-8",
    )
    child.expect(r"submitted interactive job (\d+)")
    job_id = int(child.match.group(1))
    child.expect(f"ran-as-{account.pw_name} in {work}")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 3
    job = Job.objects.get(pk=job_id)
    assert (job.owner_id, job.interactive) == (alice.pk, "shell")
    assert wait_for_job(job_id, {"cancelled"}) == "cancelled"


def test_gpulab_shell_is_a_remote_terminal(
    stack: Stack, alice: User, account: pwd.struct_passwd, tmp_path: Path
) -> None:
    import pexpect

    job_id = shell_job(stack, alice, tmp_path)
    child = pexpect.spawn(
        GPULAB,
        ["shell", "--job", str(job_id)],
        env=gpulab_env(stack, alice, tmp_path),
        timeout=60,
        encoding="utf-8",
        dimensions=(30, 100),
    )
    child.sendline("echo sum=$((6*7))")
    child.expect("sum=42")
    # The local window's size, and its change (SIGWINCH), reach the remote PTY.
    child.sendline('echo "size=$(stty size)"')
    child.expect("size=30 100")
    child.setwinsize(40, 120)
    child.sendline('echo "size=$(stty size)"')
    child.expect("size=40 120")
    # Ctrl-C interrupts the remote foreground command, not gpulab.
    # (Once the command says it runs: a ^C typed before the shell has made it
    # the foreground job would reach the shell instead.)
    child.sendline("sh -c 'echo run''ning; exec sleep 600'")
    child.expect("running")  # (typed as run''ning: only the output matches)
    child.sendcontrol("c")
    child.sendline("echo status=$?")
    child.expect("status=130")
    assert child.isalive()
    # The web process restarts: gpulab reconnects to the same shell, and what
    # was typed meanwhile reaches it.
    child.sendline("SAME=yes; echo set-$((1+1))")
    child.expect("set-2")
    stack.restart_web("web-2")
    child.sendline('echo "back=$((2*3)) same=$SAME"')
    child.expect("back=6 same=yes")
    child.sendline("exit 5")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 5


def screen(page: Any) -> str:
    """What the page's xterm.js shows (its buffer, line by line)."""
    return str(
        page.evaluate(
            """() => {
              const b = window.gpulabTerminal.buffer.active;
              const lines = [];
              for (let i = 0; i < b.length; i++) {
                lines.push(b.getLine(i).translateToString(true));
              }
              return lines.join("\\n");
            }"""
        )
    )


def test_the_job_page_terminal_survives_a_web_process_restart(
    stack: Stack, alice: User, account: pwd.struct_passwd, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    job_id = shell_job(stack, alice, tmp_path)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = collect_errors(page)
        log_in(page, stack.base_url, "alice", "pw-alice")
        page.goto(f"{stack.base_url}/jobs/{job_id}/")
        box = page.get_by_test_id("job-terminal")
        expect(box).to_have_attribute("data-state", "connected", timeout=60_000)
        page.locator(".xterm").click()
        page.keyboard.type("X=kept; echo who=$(id -un) sum=$((20+22))")
        page.keyboard.press("Enter")
        page.wait_for_function(
            "() => window.gpulabTerminal && "
            "[...Array(window.gpulabTerminal.buffer.active.length).keys()]"
            ".some(i => window.gpulabTerminal.buffer.active.getLine(i)"
            ".translateToString(true).includes('sum=42'))",
            timeout=60_000,
        )
        assert f"who={account.pw_name} sum=42" in screen(page)

        # The web process goes (the agent's link and the page's socket with
        # it); the page reconnects to the new one and attaches to the same
        # shell, which still has its variable. Reloaded, the page starts with
        # an empty screen: what it shows again is the agent's replay.
        stack.restart_web("web-2")
        expect(box).to_have_attribute("data-state", "connected", timeout=60_000)
        page.reload()
        box = page.get_by_test_id("job-terminal")
        expect(box).to_have_attribute("data-state", "connected", timeout=60_000)
        page.wait_for_function(
            "() => [...Array(window.gpulabTerminal.buffer.active.length).keys()]"
            ".some(i => window.gpulabTerminal.buffer.active.getLine(i)"
            ".translateToString(true).includes('sum=42'))",
            timeout=60_000,
        )
        page.locator(".xterm").click()
        page.keyboard.type('echo "again=$X"')
        page.keyboard.press("Enter")
        page.wait_for_function(
            "() => [...Array(window.gpulabTerminal.buffer.active.length).keys()]"
            ".some(i => window.gpulabTerminal.buffer.active.getLine(i)"
            ".translateToString(true).includes('again=kept'))",
            timeout=60_000,
        )
        assert re.search(r"again=kept", screen(page))

        # The shell's end is shown; New terminal starts another one.
        page.keyboard.type("exit 6")
        page.keyboard.press("Enter")
        expect(box).to_have_attribute("data-state", "ended", timeout=60_000)
        assert "[terminal ended (exit status 6)]" in screen(page)
        page.get_by_role("button", name="New terminal").click()
        expect(box).to_have_attribute("data-state", "connected", timeout=60_000)
        page.locator(".xterm").click()
        page.keyboard.type('echo "fresh=${X:-unset}"')
        page.keyboard.press("Enter")
        page.wait_for_function(
            "() => [...Array(window.gpulabTerminal.buffer.active.length).keys()]"
            ".some(i => window.gpulabTerminal.buffer.active.getLine(i)"
            ".translateToString(true).includes('fresh=unset'))",
            timeout=60_000,
        )
        assert not errors
