"""``python -m portal.stack.run`` and ``python -m portal.stack.up`` as a user runs
them: real processes, real servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

from portal.stack.embedded import REPO_ROOT

if TYPE_CHECKING:
    from pathlib import Path

CHILD = """
import os, sys
import psycopg, redis, dj_database_url
cfg = dj_database_url.parse(os.environ["DATABASE_URL"])
with psycopg.connect(dbname=cfg["NAME"], user=cfg["USER"], host=cfg["HOST"]) as c:
    c.execute("SELECT 1")
redis.Redis.from_url(os.environ["REDIS_URL"]).ping()
print(os.environ["DATABASE_URL"])
print(os.environ["REDIS_URL"])
print(bool(os.environ.get("DJANGO_SECRET_KEY")))
print(os.environ["CELERY_BROKER_URL"])
sys.exit(3)
"""


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY", "CELERY_BROKER_URL"}
    }
    env["GPULAB_STATE_DIR"] = str(state)
    env.update(extra)
    return env


def _redis_servers_of(state: Path) -> list[str]:
    ps = subprocess.run(
        ["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in ps.splitlines() if str(state) in line]


def test_run_exports_embedded_urls_and_returns_the_exit_code(
    short_state_dir: Path,
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "portal.stack.run", "--", sys.executable, "-c", CHILD],
        env=_env(short_state_dir),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    database_url, redis_url, has_key, broker_url = result.stdout.split()
    assert database_url.startswith("postgresql://postgres@%2F")
    assert database_url.endswith("/gpulab")
    assert redis_url == f"unix://{short_state_dir}/redis/redis.sock?db=0"
    assert has_key == "True"
    assert broker_url == (
        f"redis+socket://{short_state_dir}/redis/redis.sock?virtual_host=0"
    )
    assert _redis_servers_of(short_state_dir) == []
    assert not (short_state_dir / "pg" / "postmaster.pid").exists()


def test_run_passes_configured_urls_through_untouched(short_state_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "portal.stack.run",
            "sh", "-c", 'echo "$DATABASE_URL $REDIS_URL"; exit 0',
        ],
        env=_env(
            short_state_dir,
            DATABASE_URL="postgres://u@db.invalid/x",
            REDIS_URL="redis://r.invalid:6379/0",
        ),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "postgres://u@db.invalid/x",
        "redis://r.invalid:6379/0",
    ]
    assert not (short_state_dir / "pg").exists()


def _up(state: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "portal.stack.up"],
        env=_env(state, **extra),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_up_explains_a_bad_demo_nodes_spec_before_starting_anything(
    short_state_dir: Path,
) -> None:
    result = _up(short_state_dir, GPULAB_DEMO_NODES="2x4:A100-80GB+banana")
    assert result.returncode == 2
    assert "GPULAB_DEMO_NODES='2x4:A100-80GB+banana' is not a cluster spec" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not (short_state_dir / "pg").exists()


def test_up_explains_a_busy_port(short_state_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _up(short_state_dir, PORT=str(port))
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is busy" in result.stderr
    assert not (short_state_dir / "pg").exists()


def test_the_image_and_compose_run_the_web_process_as_make_up_does() -> None:
    """One set of uvicorn options for ``make up``, the image and compose (frame
    size, keep-alive); the keep-alive outlasts the CLI's own (httpx), so an idle
    connection is closed by the client, never under a request it is sending."""
    import json
    import re
    from pathlib import Path

    import httpx

    from portal.stack.up import processes

    argv = processes(Path("/nonexistent"), [], 8000)["web"]
    options = argv[argv.index("--port") + 2 :]
    cmd = re.search(r"^CMD (\[.*\])$", (REPO_ROOT / "Dockerfile").read_text(), re.M)
    assert cmd is not None
    image = json.loads(cmd.group(1))
    compose = re.search(
        r'command: (\["uvicorn".*\])', (REPO_ROOT / "docker-compose.yml").read_text()
    )
    assert compose is not None
    for command in (image, json.loads(compose.group(1))):
        assert command[command.index("--port") + 2 :] == options
    keep_alive = float(options[options.index("--timeout-keep-alive") + 1])
    assert keep_alive > httpx.Limits(max_connections=1).keepalive_expiry
