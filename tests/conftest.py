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


@pytest.fixture(autouse=True)
def _samples_flushed(
    request: pytest.FixtureRequest, django_db_blocker: Any
) -> Iterator[None]:
    """After a test that commits (``transaction=True``, the e2e stack), empty the
    GPU samples: Django's flush after it empties the tables of managed models
    only, and ``scheduler_gpusample`` (day partitions, ``managed = False``) would
    carry its samples into whichever test runs next."""
    yield
    marker = request.node.get_closest_marker("django_db")
    commits = "transactional_db" in request.fixturenames or (
        marker is not None and marker.kwargs.get("transaction", False)
    )
    if commits:
        from django.db import connection

        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute("TRUNCATE scheduler_gpusample")


@pytest.fixture(autouse=True)
def _fast_passwords(request: pytest.FixtureRequest) -> None:
    """Personas' passwords are hashed at creation: a fast hasher saves ~1 s each.
    Not in e2e tests: the real server processes they log in to use the default
    hashers and could not check an MD5 hash."""
    if request.node.get_closest_marker("e2e") is None:
        settings = request.getfixturevalue("settings")
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


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
