"""What the agent logs about reaching the portal: one line per event a person
needs, no traceback for the network's expected errors. An agent started before
the web server listens waits quietly (one INFO line, each retry at DEBUG); a
link that was up and is lost is one WARNING; so is a portal unreachable past
``warn_unreachable_after_s``."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from agent_helpers import ROOT, Portal, await_until, make_agent, running

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


RETRY = re.compile(r" in \d+\.\d s$")


def free_port() -> int:
    """A loopback port nothing listens on (yet)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spawn_verbose_agent(url: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    """The agent's own command, with debug logging so that each retry shows."""
    token = tmp_path / "token"
    token.write_text("tok-quiet\n")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents",
            "--server",
            url,
            "--token-file",
            str(token),
            "--simulate",
            "1xA100-80GB",
            "--state-dir",
            str(tmp_path / "state"),
            "--backoff-base",
            "0.05",
            "--backoff-cap",
            "0.2",
            "-v",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "agent.log").open("ab"),
    )


def retries(tmp_path: Path) -> int:
    """How many retries the agent has planned ("... in 0.1 s")."""
    return sum(bool(RETRY.search(line)) for line in link_lines(tmp_path))


def link_lines(tmp_path: Path) -> list[str]:
    """The agent's log lines about its link (and any traceback)."""
    text = (tmp_path / "agent.log").read_text()
    return [
        line
        for line in text.splitlines()
        if " agents.link: " in line or "Traceback" in line or " WARNING " in line
    ]


async def test_an_agent_started_before_the_portal_waits_quietly_until_it_listens(
    tmp_path: Path,
) -> None:
    port = free_port()
    url = f"ws://127.0.0.1:{port}/ws/agent/"
    agent = spawn_verbose_agent(f"ws://127.0.0.1:{port}", tmp_path)
    portal = Portal()
    try:
        # at least three refused tries before the portal listens
        await await_until(lambda: retries(tmp_path) >= 2, timeout=30)
        portal.port = port
        await portal.start()
        await await_until(lambda: portal.of("hello"), timeout=15)
        await await_until(
            lambda: any("connected to" in line for line in link_lines(tmp_path))
        )

        lines = link_lines(tmp_path)
        connected = next(i for i, line in enumerate(lines) if "connected to" in line)
        before = lines[:connected]
        assert not [line for line in before if " WARNING " in line or " ERROR " in line]
        assert "Traceback" not in (tmp_path / "agent.log").read_text()
        assert before[0].endswith(
            f" INFO agents.link: waiting for the portal at {url} (connection refused)"
        )
        assert len(before) >= 3
        assert all(" DEBUG agents.link: " in line for line in before[1:]), before
        assert lines[connected].endswith(f" INFO agents.link: connected to {url}")

        # The portal goes away: one warning says so, then the retries are quiet.
        await portal.stop()
        tried = retries(tmp_path)
        await await_until(lambda: retries(tmp_path) >= tried + 3, timeout=30)
        after = link_lines(tmp_path)[connected + 1 :]
        warnings = [line for line in after if " WARNING " in line]
        assert len(warnings) == 1, after
        assert f" WARNING agents.link: link to {url} down (" in warnings[0]
        assert not [line for line in after if " INFO " in line or " ERROR " in line]
        assert "Traceback" not in (tmp_path / "agent.log").read_text()
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(10)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        await portal.stop()


async def test_a_portal_unreachable_past_the_threshold_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    url = f"ws://127.0.0.1:{port}/ws/agent/"
    agent = make_agent(
        f"ws://127.0.0.1:{port}", tmp_path / "state", warn_unreachable_after_s=0.3
    )
    caplog.set_level(logging.DEBUG, logger="agents.link")

    def link_records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "agents.link"]

    def warned() -> list[logging.LogRecord]:
        return [r for r in link_records() if r.levelno >= logging.WARNING]

    portal = Portal()
    try:
        async with running(agent):
            await await_until(warned, timeout=10)
            seen = len(link_records())
            # more retries after the warning, none of them another warning
            await await_until(lambda: len(link_records()) >= seen + 3, timeout=10)
            portal.port = port
            await portal.start()
            await await_until(lambda: portal.of("hello"), timeout=10)
            await await_until(lambda: "connected to" in link_records()[-1].getMessage())
    finally:
        await portal.stop()  # after the agent: its link is not lost, it shut down

    records = link_records()
    assert records[0].levelno == logging.INFO
    assert records[0].getMessage() == (
        f"waiting for the portal at {url} (connection refused)"
    )
    (warning,) = [r for r in records if r.levelno >= logging.WARNING]
    assert warning.levelno == logging.WARNING
    assert warning.getMessage().startswith(f"portal at {url} unreachable for ")
    assert warning.getMessage().endswith(" s (connection refused); still retrying")
    connected = next(r for r in records if "connected to" in r.getMessage())
    assert connected.getMessage().startswith(f"connected to {url} (unreachable for ")
    assert all(r.exc_info is None for r in records)
