"""The embedded servers are real PostgreSQL and Redis, reachable by the URLs we
export, and PostgreSQL keeps its data across a restart."""

from __future__ import annotations

import asyncio
import shutil
import signal
import stat
from typing import TYPE_CHECKING

import dj_database_url
import psycopg
import pytest
import redis
from kombu import Connection  # type: ignore[attr-defined]

from portal.stack.embedded import (
    MAX_SOCKET_PATH,
    StackError,
    ensure_services,
    redis_socket_path,
    secret_key,
    start_postgres,
    start_redis,
)
from portal.stack.urls import celery_broker_url

if TYPE_CHECKING:
    from pathlib import Path


def _connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    """Connect the way Django does: through dj-database-url's parse."""
    cfg = dj_database_url.parse(url)
    assert cfg["HOST"].startswith("/")  # the socket dir, as Django code expects
    return psycopg.connect(
        dbname=cfg["NAME"], user=cfg["USER"], host=cfg["HOST"], autocommit=True
    )


def test_it_starts_postgres_and_keeps_data_across_a_restart(
    short_state_dir: Path,
) -> None:
    pg = start_postgres(short_state_dir)
    try:
        assert pg.started
        encoded = str(pg.socket_dir).replace("/", "%2F")
        assert pg.url == f"postgresql://postgres@{encoded}/gpulab"
        with psycopg.connect(pg.url) as conn:  # libpq reads the same URL
            assert conn.info.host == str(pg.socket_dir)
        with _connect(pg.url) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("gpulab",)
            conn.execute("CREATE TABLE kept (v text)")
            conn.execute("INSERT INTO kept VALUES ('survives')")
    finally:
        pg.stop()
    with_pid = pg.pgdata / "postmaster.pid"
    assert not with_pid.exists(), "the server we started was not stopped"

    again = start_postgres(short_state_dir)
    try:
        assert again.started
        with _connect(again.url) as conn:
            assert conn.execute("SELECT v FROM kept").fetchall() == [("survives",)]
    finally:
        again.stop()


def test_it_starts_redis_for_redis_py_channels_and_celery(
    short_state_dir: Path,
) -> None:
    server = start_redis(short_state_dir)
    try:
        assert server.url == f"unix://{short_state_dir}/redis/redis.sock?db=0"
        assert stat.S_IMODE(server.socket_path.stat().st_mode) == 0o700

        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()

        async def channel_round_trip() -> object:
            from channels_redis.core import (  # type: ignore[import-untyped]
                RedisChannelLayer,
            )

            layer = RedisChannelLayer(hosts=[{"address": server.url}], prefix="t")
            name = await layer.new_channel()
            await layer.send(name, {"type": "hello"})
            message = await layer.receive(name)
            await layer.close_pools()
            return message

        assert asyncio.run(channel_round_trip()) == {"type": "hello"}

        broker = celery_broker_url(server.url)
        assert broker == f"redis+socket://{server.socket_path}?virtual_host=0"
        with Connection(broker) as conn:  # type: ignore[no-untyped-call]
            queue = conn.SimpleQueue("stack-test")
            queue.put({"n": 1})
            message = queue.get(timeout=5)
            message.ack()
            assert message.payload == {"n": 1}
            queue.close()
    finally:
        server.stop()
    assert server.process is not None
    assert server.process.poll() is not None


def test_it_reuses_a_running_redis_and_leaves_it_running(
    short_state_dir: Path,
) -> None:
    first = start_redis(short_state_dir)
    try:
        second = start_redis(short_state_dir)
        assert second.process is None
        second.stop()
        assert redis.Redis.from_url(first.url).ping()
    finally:
        first.stop()


def test_a_redis_outlives_its_starter_while_another_user_holds_it(
    short_state_dir: Path,
) -> None:
    starter = start_redis(short_state_dir)
    joiner = start_redis(short_state_dir)
    try:
        starter.stop()
        assert redis.Redis.from_url(joiner.url).ping()
    finally:
        joiner.stop()  # the last user stops it, though it did not start it
    assert starter.process is not None
    assert starter.process.wait(10) == 0
    assert not joiner.socket_path.exists()


def test_a_redis_that_does_not_answer_is_replaced_only_when_nobody_holds_it(
    short_state_dir: Path,
) -> None:
    wedged = start_redis(short_state_dir)
    assert wedged.process is not None and wedged.lease is not None
    wedged.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(StackError) as refused:
            start_redis(short_state_dir, timeout=1)
        assert (
            f"on {wedged.socket_path} (pid {wedged.process.pid}) is in use by "
            f"another gpulab process but does not answer"
        ) in str(refused.value)

        # Its user dies (the kernel drops its lease): the next one replaces it.
        wedged.lease.close()
        fresh = start_redis(short_state_dir, timeout=1)
        try:
            assert fresh.process is not None
            assert redis.Redis.from_url(fresh.url).ping()
            assert wedged.process.wait(10) == -signal.SIGKILL
        finally:
            fresh.stop()
    finally:
        if wedged.process.poll() is None:
            wedged.process.kill()
            wedged.process.wait()


def test_it_moves_the_redis_socket_to_tmp_when_the_state_dir_is_long(
    short_state_dir: Path,
) -> None:
    deep = short_state_dir / ("d" * 60) / ("e" * 60)
    path = redis_socket_path(deep)
    assert len(str(path)) <= MAX_SOCKET_PATH
    assert str(path).startswith("/tmp/gpulab-")
    assert redis_socket_path(deep) == path  # stable for one state dir
    shutil.rmtree(path.parent.parent)


def test_it_starts_only_what_the_urls_do_not_configure(
    short_state_dir: Path,
) -> None:
    env = {
        "GPULAB_STATE_DIR": str(short_state_dir),
        "DATABASE_URL": "postgres://x@db.invalid/x",
        "REDIS_URL": "redis://redis.invalid:6379/0",
    }
    with ensure_services(env) as services:
        assert services.postgres is None
        assert services.redis is None
        assert services.env["DATABASE_URL"] == env["DATABASE_URL"]
        assert services.env["REDIS_URL"] == env["REDIS_URL"]
        assert "CELERY_BROKER_URL" not in services.env
    assert not (short_state_dir / "pg").exists()


def test_it_keeps_one_secret_key_with_mode_600(short_state_dir: Path) -> None:
    key = secret_key(short_state_dir)
    assert len(key) >= 50
    assert secret_key(short_state_dir) == key
    mode = (short_state_dir / "secret_key").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_celery_broker_url_translates_only_unix_urls() -> None:
    assert celery_broker_url("redis://h:6379/2") == "redis://h:6379/2"
    assert celery_broker_url("rediss://h:6380/0") == "rediss://h:6380/0"
    assert (
        celery_broker_url("unix:///tmp/r.sock?db=3")
        == "redis+socket:///tmp/r.sock?virtual_host=3"
    )
    assert (
        celery_broker_url("unix://:pw@/tmp/r.sock")
        == "redis+socket://:pw@/tmp/r.sock?virtual_host=0"
    )
