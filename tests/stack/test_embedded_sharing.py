"""Entry points share one state dir's embedded servers: whoever uses a server keeps it
running, the last one out stops it, and a user killed outright leaves at worst a
server the next entry point reuses. Real ``portal.stack.run`` processes, real
servers."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from portal.stack.embedded import REPO_ROOT

if TYPE_CHECKING:
    from collections.abc import Iterator

# The command each entry point runs: it says which servers it reaches (redis-server's
# pid, PostgreSQL's start time) once on start and again for every line it reads,
# connecting afresh each time; it exits at end of input.
USER = """
import os, sys
import dj_database_url, psycopg, redis
cfg = dj_database_url.parse(os.environ["DATABASE_URL"])
def check():
    with psycopg.connect(
        dbname=cfg["NAME"], user=cfg["USER"], host=cfg["HOST"], autocommit=True
    ) as conn:
        (started,) = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.incr("visits")
    pid = client.info("server")["process_id"]
    client.close()
    print(pid, started.isoformat(), flush=True)
check()
for _ in sys.stdin:
    check()
"""


_users: list[User] = []


class User:
    """``python -m portal.stack.run -- python -c USER`` in a process group of its
    own (so it can be killed whole, as a closed terminal would)."""

    def __init__(self, state: Path) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}
        }
        env["GPULAB_STATE_DIR"] = str(state)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "portal.stack.run",
                "--",
                sys.executable,
                "-c",
                USER,
            ],
            env=env,
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        _users.append(self)

    def line(self, timeout: float = 60) -> str:
        """The next report; fails naming the entry point's errors if none comes."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        report = self.proc.stdout.readline() if ready else ""
        if not report:
            self.proc.kill()
            _, err = self.proc.communicate()
            pytest.fail(f"no report from the entry point; its stderr:\n{err}")
        return report.strip()

    def ask(self) -> str:
        """Have the command reach both servers again; what it reached."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.line()

    def leave(self) -> int:
        """End the command's input; the entry point's exit code, once it has
        stopped whatever it must."""
        _, err = self.proc.communicate(timeout=60)
        assert "Traceback" not in err, err
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the entry point and its command at once."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=60)


def servers(state: Path) -> list[str]:
    """The postmaster and redis-server running for ``state`` (seen by ps)."""
    ps = subprocess.run(
        ["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True
    ).stdout
    return sorted(
        line
        for line in ps.splitlines()
        if f"-D {state}/pg " in line or f"unixsocket:{state}/" in line
    )


def assert_one_server_each(state: Path) -> None:
    running = servers(state)
    assert len(running) == 2, running
    assert "postgres -D" in running[0]
    assert "redis-server" in running[1]


def assert_stopped(state: Path) -> None:
    assert servers(state) == []
    assert not (state / "pg" / "postmaster.pid").exists()
    assert not (state / "redis" / "redis.sock").exists()


def _fresh_state() -> Iterator[Path]:
    state = Path(tempfile.mkdtemp(prefix="gls-", dir="/tmp"))
    yield state
    # A failed test may leave servers: one more user, the last, stops them.
    if servers(state):
        subprocess.run(
            [sys.executable, "-m", "portal.stack.run", "--", "true"],
            env={
                **{
                    k: v
                    for k, v in os.environ.items()
                    if k not in {"DATABASE_URL", "REDIS_URL"}
                },
                "GPULAB_STATE_DIR": str(state),
            },
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=60,
            check=False,
        )
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_user_outlives_its_test() -> Iterator[None]:
    yield
    while _users:
        user = _users.pop()
        if user.proc.poll() is None:
            user.kill()


@pytest.fixture(scope="module")
def shared_state() -> Iterator[Path]:
    """One state dir for this module's tests (initdb runs once); each test leaves
    its servers stopped."""
    yield from _fresh_state()


@pytest.fixture
def fresh_state() -> Iterator[Path]:
    yield from _fresh_state()


def test_the_starter_leaving_stops_nothing_another_user_still_uses(
    shared_state: Path,
) -> None:
    starter = User(shared_state)
    reached = starter.line()
    joiner = User(shared_state)
    assert joiner.line() == reached  # the same servers, reused
    assert_one_server_each(shared_state)

    assert starter.leave() == 0
    assert joiner.ask() == reached  # both still answer the one left
    assert_one_server_each(shared_state)

    assert joiner.leave() == 0  # the last one out stops both, though it
    assert_stopped(shared_state)  # started neither


def test_two_entry_points_starting_at_once_start_one_server_each_kind(
    fresh_state: Path,
) -> None:
    users = [User(fresh_state), User(fresh_state)]
    first, second = (user.line() for user in users)
    assert first == second
    assert_one_server_each(fresh_state)
    assert [user.leave() for user in users] == [0, 0]
    assert_stopped(fresh_state)


def test_users_killed_outright_leave_servers_the_next_one_reuses_and_stops(
    shared_state: Path,
) -> None:
    starter = User(shared_state)
    reached = starter.line()
    survivor = User(shared_state)
    assert survivor.line() == reached

    starter.kill()  # the server is not tied to its starter's life
    assert survivor.ask() == reached
    survivor.kill()  # nobody is left, but nobody stopped the servers
    assert_one_server_each(shared_state)

    # No stale lock blocks the next entry point; it joins those servers and, as
    # their only user, stops them when it leaves.
    nxt = User(shared_state)
    assert nxt.line() == reached
    assert_one_server_each(shared_state)
    assert nxt.leave() == 0
    assert_stopped(shared_state)
