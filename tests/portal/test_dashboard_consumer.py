"""The browser dashboard websocket (/ws/dashboard/): session auth, Origin check,
and job subscriptions limited to jobs the user may see."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.db import connections
from django.test import Client

from portal.asgi import application
from scheduler import events
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Job

pytestmark = [pytest.mark.anyio, pytest.mark.django_db(transaction=True)]

TIMEOUT = 5
GOOD_ORIGIN = (b"origin", b"http://localhost")


@pytest.fixture(autouse=True)
async def _close_db_connections() -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


def session_cookie(user: User) -> tuple[bytes, bytes]:
    client = Client()
    client.force_login(user)
    value = client.cookies[django_settings.SESSION_COOKIE_NAME].value
    return (b"cookie", f"{django_settings.SESSION_COOKIE_NAME}={value}".encode())


@pytest.fixture
def cookies(
    alice: User, bob: User, charlie: User, admin_user: User
) -> dict[str, tuple[bytes, bytes]]:
    """A session cookie header per persona (logging in touches the database)."""
    users = {"alice": alice, "bob": bob, "charlie": charlie, "admin": admin_user}
    return {name: session_cookie(user) for name, user in users.items()}


@pytest.fixture
def alice_job(alice: User) -> Job:
    return JobFactory(owner=alice)


async def dashboard(*headers: tuple[bytes, bytes]) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(application, "/ws/dashboard/", headers=list(headers))
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    return comm


async def subscribe(comm: WebsocketCommunicator, job_id: int) -> dict[str, Any]:
    await comm.send_json_to({"subscribe": "job", "id": job_id})
    return await comm.receive_json_from(timeout=TIMEOUT)


async def broadcast(job_id: int, status: str, message: str) -> None:
    await database_sync_to_async(events.broadcast_job_status)(job_id, status, message)


async def test_it_closes_an_unauthenticated_connection(transactional_db: None) -> None:
    comm = WebsocketCommunicator(application, "/ws/dashboard/", headers=[GOOD_ORIGIN])

    connected, code = await comm.connect(timeout=TIMEOUT)

    assert connected is False
    assert code == 4401


async def test_it_rejects_a_foreign_origin(cookies: dict[str, Any]) -> None:
    cookie = cookies["alice"]
    comm = WebsocketCommunicator(
        application,
        "/ws/dashboard/",
        headers=[cookie, (b"origin", b"http://evil.example")],
    )

    connected, _ = await comm.connect(timeout=TIMEOUT)

    assert connected is False


async def test_it_sends_the_owner_her_jobs_status(
    cookies: dict[str, Any], alice_job: Job
) -> None:
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)

    reply = await subscribe(comm, alice_job.pk)
    await broadcast(alice_job.pk, "running", "running on node-a")
    update = await comm.receive_json_from(timeout=TIMEOUT)

    assert reply == {"subscribed": f"job.{alice_job.pk}"}
    assert update == {
        "type": "job.status",
        "job_id": alice_job.pk,
        "status": "running",
        "message": "running on node-a",
    }
    await comm.disconnect()


@pytest.mark.parametrize("persona", ["bob", "charlie"])
async def test_it_refuses_a_subscription_to_someone_elses_job(
    request: pytest.FixtureRequest,
    cookies: dict[str, Any],
    alice_job: Job,
    persona: str,
) -> None:
    other: User = request.getfixturevalue(persona)
    own_job = await database_sync_to_async(JobFactory)(owner=other)
    comm = await dashboard(cookies[persona], GOOD_ORIGIN)

    refused = await subscribe(comm, alice_job.pk)
    await subscribe(comm, own_job.pk)
    await broadcast(alice_job.pk, "running", "alice's secret")
    await broadcast(own_job.pk, "running", "mine")
    first = await comm.receive_json_from(timeout=TIMEOUT)

    assert refused == {"error": "no such job"}
    assert first["job_id"] == own_job.pk  # alice's update never arrived
    await comm.disconnect()


async def test_it_lets_staff_watch_any_job(
    cookies: dict[str, Any], alice_job: Job
) -> None:
    comm = await dashboard(cookies["admin"], GOOD_ORIGIN)

    reply = await subscribe(comm, alice_job.pk)

    assert reply == {"subscribed": f"job.{alice_job.pk}"}
    await comm.disconnect()


@pytest.mark.parametrize(
    "message",
    [{"subscribe": "node", "id": 1}, {"subscribe": "job", "id": "1"}, [1, 2]],
    ids=["other-kind", "id-not-int", "not-an-object"],
)
async def test_it_answers_a_bad_subscription_with_an_error(
    cookies: dict[str, Any], message: Any
) -> None:
    comm = await dashboard(cookies["alice"], GOOD_ORIGIN)

    await comm.send_json_to(message)
    reply = await comm.receive_json_from(timeout=TIMEOUT)

    assert "error" in reply
    await comm.disconnect()
