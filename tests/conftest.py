"""Shared fixtures: personas, a registered cluster, and per-run isolation.

Every test run gets its own PostgreSQL test database name and its own Redis prefix
(channel layer, Celery queue, flags), so two runs on one machine never see each
other. Real PostgreSQL and Redis always (``make test`` starts embedded ones when
``DATABASE_URL`` / ``REDIS_URL`` are unset).
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from agents import protocol

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames, Broker, Channels

RUN_ID = uuid.uuid4().hex[:10]
REDIS_PREFIX = f"gpulab-test-{RUN_ID}"
TEST_DB_NAME = f"test_gpulab_{RUN_ID}"


def pytest_configure(config: pytest.Config) -> None:
    from django.conf import settings

    settings.REDIS_PREFIX = REDIS_PREFIX
    layer: dict[str, Any] = settings.CHANNEL_LAYERS["default"]
    layer["CONFIG"]["prefix"] = f"{REDIS_PREFIX}:asgi"
    settings.CELERY_TASK_DEFAULT_QUEUE = f"{REDIS_PREFIX}.default"
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        "global_keyprefix": f"{REDIS_PREFIX}:celery:"
    }
    # Processes started by tests (ASGI server, worker, agents) inherit these.
    os.environ["GPULAB_REDIS_PREFIX"] = REDIS_PREFIX
    _install_table_reset()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Drop this run's Redis keys (queues, channel groups, flags)."""
    url = os.environ.get("REDIS_URL")
    if not url:
        return
    import redis

    try:
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{REDIS_PREFIX}*", count=1000):
            client.delete(key)
        client.close()
    except redis.RedisError:
        pass


@pytest.fixture(scope="session")
def django_db_modify_db_settings() -> None:
    """A test database name unique to this run (pytest-django's hook)."""
    from django.conf import settings

    for db_settings in settings.DATABASES.values():
        db_settings.setdefault("TEST", {})["NAME"] = TEST_DB_NAME


# ------------------------------------------------------------------ database reset


class _TableReset:
    """How a test that commits (``transaction=True``, ``transactional_db``, the e2e
    stack, ``live_server``) leaves the database: as Django's flush does, for less.

    The flush empties every managed table with one ``TRUNCATE`` and then emits
    ``post_migrate``, whose receivers recreate every content type and permission:
    ~1.5 s per test on a loaded 2-core machine, most of the cost of such a test's
    teardown. The first flush of a worker is that real one; the rows it leaves
    (what ``post_migrate`` made) are remembered with a digest of their contents.
    Later resets ``DELETE`` from the tables that have rows, except those, in one
    transaction (Django's foreign keys are deferred: checked at commit), and check
    that the remembered rows are still exactly as the flush left them; when a test
    changed them, the real flush runs again. Either way the next test finds what
    the flush would leave, and also an empty ``scheduler_gpusample`` (day
    partitions, ``managed = False``: no flush empties it), whose samples would
    otherwise reach whichever test runs next."""

    def __init__(self) -> None:
        # database alias -> {table: digest of its rows} after the last real flush
        self.kept: dict[str, dict[str, str]] = {}

    @staticmethod
    def tables(connection: Any) -> list[str]:
        """Every model's table (managed or not) that exists as a table."""
        from django.apps import apps

        existing = set(connection.introspection.table_names(include_views=False))
        return sorted(
            {
                model._meta.db_table
                for model in apps.get_models(include_auto_created=True)
                if model._meta.db_table in existing
            }
        )

    @staticmethod
    def with_rows(cursor: Any, connection: Any, tables: list[str]) -> list[str]:
        if not tables:
            return []
        quote = connection.ops.quote_name
        cursor.execute(
            " UNION ALL ".join(
                f"SELECT %s FROM (SELECT 1 FROM {quote(t)} LIMIT 1) AS s"
                for t in tables
            ),
            tables,
        )
        return [row[0] for row in cursor.fetchall()]

    @staticmethod
    def digests(cursor: Any, connection: Any, tables: list[str]) -> dict[str, str]:
        if not tables:
            return {}
        quote = connection.ops.quote_name
        cursor.execute(
            " UNION ALL ".join(
                f"SELECT %s, md5(coalesce(string_agg(r::text, ',' ORDER BY r::text),"
                f" '')) FROM {quote(t)} AS r"
                for t in tables
            ),
            tables,
        )
        return dict(cursor.fetchall())

    def delete_rows(self, alias: str, keep: dict[str, str] | None) -> bool:
        """Empty every table with rows except ``keep``'s, unless a table of
        ``keep`` no longer has the digest given: then change nothing, False."""
        from django.db import DatabaseError, connections, transaction

        connection = connections[alias]
        quote = connection.ops.quote_name
        kept = keep or {}
        try:
            with transaction.atomic(using=alias), connection.cursor() as cursor:
                if self.digests(cursor, connection, sorted(kept)) != kept:
                    return False
                tables = [t for t in self.tables(connection) if t not in kept]
                cursor.execute("SET CONSTRAINTS ALL DEFERRED")
                for table in self.with_rows(cursor, connection, tables):
                    cursor.execute(f"DELETE FROM {quote(table)}")
        except DatabaseError:  # a foreign key not deferrable: the flush's TRUNCATE
            return False
        return True

    def flush(self, alias: str) -> None:
        """Django's flush (``post_migrate`` included), the unmanaged tables
        emptied, and the rows left remembered."""
        from django.core.management import call_command
        from django.db import connections

        call_command(
            "flush",
            verbosity=0,
            interactive=False,
            database=alias,
            reset_sequences=False,
        )
        connection = connections[alias]
        flushed = set(
            connection.introspection.django_table_names(
                only_existing=True, include_views=False
            )
        )
        with connection.cursor() as cursor:
            tables = self.tables(connection)
            for table in self.with_rows(cursor, connection, tables):
                if table not in flushed:  # unmanaged
                    cursor.execute(f"DELETE FROM {connection.ops.quote_name(table)}")
            left = self.with_rows(cursor, connection, tables)
            self.kept[alias] = self.digests(cursor, connection, left)

    def reset(self, alias: str) -> None:
        keep = self.kept.get(alias)
        if keep is None or not self.delete_rows(alias, keep):
            self.flush(alias)


_TABLE_RESET = _TableReset()


def _install_table_reset() -> None:
    """Route ``TransactionTestCase``'s flush (pytest-django's transactional tests)
    through ``_TABLE_RESET``; the cases it does not cover (``available_apps``,
    serialized rollback: none here) keep Django's own."""
    from django.test import TransactionTestCase

    flush = TransactionTestCase._fixture_teardown

    def _fixture_teardown(self: TransactionTestCase) -> None:
        if self.available_apps is not None or self.serialized_rollback:
            flush(self)
            return
        for alias in self._databases_names(include_mirrors=False):
            _TABLE_RESET.reset(alias)

    TransactionTestCase._fixture_teardown = _fixture_teardown  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _fast_passwords(request: pytest.FixtureRequest) -> None:
    """Personas' passwords are hashed at creation: a fast hasher saves ~1 s each.
    Not in e2e tests: the real server processes they log in to use the default
    hashers and could not check an MD5 hash."""
    if request.node.get_closest_marker("e2e") is None:
        settings = request.getfixturevalue("settings")
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _no_activity_remembered() -> None:
    """Each test starts with this process remembering no interactive job's last
    use (``portal.idle.activity``): job ids repeat across tests."""
    from portal.idle import activity

    activity._written.clear()


@pytest.fixture(autouse=True)
def _channel_layer_per_test() -> Iterator[None]:
    """Each test gets its own channel layer instance. channels_redis keeps one
    asyncio lock per channel prefix (``receive_clean_locks``), bound to the event
    loop of the first receive that had to wait on it; each async test runs its own
    loop, so a layer kept from an earlier test fails such a receive with "bound to
    a different event loop" (the layer itself is made for one loop per process)."""
    yield
    from channels.layers import channel_layers

    channel_layers.backends.clear()


@pytest.fixture(autouse=True)
def _no_pass_queued(request: pytest.FixtureRequest) -> None:
    """Each test starts with no scheduling pass marked queued (a pass request
    marks it, scheduler.pass_requests.claim_pass_request, and a later request
    enqueues nothing while it is set) and, outside e2e tests (whose processes
    consume the queue as they run), with this run's Celery queue empty."""
    from scheduler.pass_requests import _queued_key, _redis_client

    _redis_client().delete(_queued_key())
    if request.node.get_closest_marker("e2e") is None:
        from tests.capture import Broker

        broker = Broker()
        broker.purge()
        broker.close()


@pytest.fixture
def passes() -> Iterator[Broker]:
    """The tasks this test published to the real broker (``passes.passes()``: how
    many scheduling passes were enqueued); emptied after the test."""
    from tests.capture import Broker

    broker = Broker()
    broker.purge()
    yield broker
    broker.purge()
    broker.close()


@pytest.fixture
def channels() -> Iterator[Channels]:
    """A listener on the real channel layer: ``channels.join("job.7")`` then
    ``channels.messages("job.7")``."""
    from tests.capture import Channels

    listener = Channels()
    yield listener
    listener.close()


@pytest.fixture
def sent(db: None, channels: Channels) -> Iterator[AgentFrames]:
    """The frames sent to node agents, read back from the real channel layer:
    every node's ``agent.<id>`` group is listened to (those created during the
    test too). ``sent.calls()``, ``sent.only()``, ``sent.of_type("job.kill")``."""
    from tests.capture import AgentFrames

    frames = AgentFrames(channels)
    yield frames
    frames.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ------------------------------------------------------------------ personas


@pytest.fixture
def groups(db: None) -> dict[str, Any]:
    from scheduler.models import Group

    return {
        "vision": Group.objects.create(name="vision"),
        "nlp": Group.objects.create(name="nlp"),
    }


def _user(username: str, group: Any, *, staff: bool = False) -> User:
    from django.contrib.auth.models import User

    from scheduler.models import Membership

    user = User.objects.create_user(
        username, f"{username}@lab.example", "pw-" + username, is_staff=staff
    )
    if group is not None:
        Membership.objects.create(user=user, group=group)
    return user


@pytest.fixture
def alice(groups: dict[str, Any]) -> User:
    """The job owner."""
    return _user("alice", groups["vision"])


@pytest.fixture
def bob(groups: dict[str, Any]) -> User:
    """Same lab group as alice."""
    return _user("bob", groups["vision"])


@pytest.fixture
def charlie(groups: dict[str, Any]) -> User:
    """Another group: an outsider to alice's jobs."""
    return _user("charlie", groups["nlp"])


@pytest.fixture
def admin_user(groups: dict[str, Any]) -> User:
    return _user("root", groups["vision"], staff=True)


# ------------------------------------------------------------------ cluster


def hello_data(
    gpus: int = 4,
    memory_mib: int = 81920,
    name: str = "NVIDIA A100-80GB",
    host: str = "n",
) -> protocol.HelloData:
    return protocol.HelloData(
        agent_version="test",
        hostname=host,
        incarnation=uuid.uuid4().hex,
        driver_version="550.54",
        cuda_version="12.4",
        gpus=[
            protocol.GpuInfo(
                index=i,
                uuid=f"GPU-{host}-{i}-{uuid.uuid4().hex[:8]}",
                name=name,
                memory_total_mib=memory_mib,
            )
            for i in range(gpus)
        ],
    )


def make_node(name: str, gpus: int = 4, memory_mib: int = 81920) -> tuple[Node, str]:
    """A registered node that has said hello with ``gpus`` GPUs."""
    from scheduler import services

    node, token = services.create_node(name)
    services.record_hello(node.pk, hello_data(gpus, memory_mib, host=name))
    node.refresh_from_db()
    return node, token


@pytest.fixture
def cluster(db: None) -> list[Node]:
    """Two UP nodes: node-a with 4 A100-80GB, node-b with 2."""
    return [make_node("node-a", 4)[0], make_node("node-b", 2)[0]]


# ------------------------------------------------------------------ live dashboards


@pytest.fixture
def clean_live() -> None:
    """Forget the live dashboards' Redis state (published cluster state, gates,
    watched groups) left by an earlier test of this run: each test starts as a
    fresh deployment would."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{REDIS_PREFIX}:live:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
