"""A user the directory removed loses their open live pages: the dashboard
websocket (real channels_redis on Redis, real sessions in PostgreSQL) is closed
4401; another user's stays open."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from channels.db import database_sync_to_async
from django.db import connections

from portal.directory.identity import deactivate_user
from tests.portal.test_dashboard_consumer import (
    GOOD_ORIGIN,
    TIMEOUT,
    dashboard,
    session_cookie,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.anyio, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
async def _close_db_connections(clean_live: None) -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


async def test_a_removal_closes_the_users_websockets(alice: User, bob: User) -> None:
    alice_cookie, bob_cookie = await database_sync_to_async(
        lambda: (session_cookie(alice), session_cookie(bob))
    )()
    hers = await dashboard(alice_cookie, GOOD_ORIGIN)
    his = await dashboard(bob_cookie, GOOD_ORIGIN)
    await hers.send_json_to({"subscribe": "queue"})
    assert await hers.receive_json_from(timeout=TIMEOUT) == {"subscribed": "queue"}

    await database_sync_to_async(deactivate_user)(alice, "removed from the directory")

    closed = await hers.receive_output(timeout=TIMEOUT)
    assert closed == {"type": "websocket.close", "code": 4401}
    await his.send_json_to({"subscribe": "queue"})
    assert await his.receive_json_from(timeout=TIMEOUT) == {"subscribed": "queue"}
    await his.disconnect()
    # A new connection with her old cookie is refused: the session is gone.
    comm = await _connect(alice_cookie)
    assert comm == (False, 4401)


async def _connect(cookie: tuple[bytes, bytes]) -> tuple[bool, Any]:
    from channels.testing import WebsocketCommunicator

    from portal.asgi import application

    comm = WebsocketCommunicator(
        application, "/ws/dashboard/", headers=[cookie, GOOD_ORIGIN]
    )
    result: tuple[bool, Any] = await comm.connect(timeout=TIMEOUT)
    return result
