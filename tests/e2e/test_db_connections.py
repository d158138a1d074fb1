"""The web process's database connections stay bounded under concurrent requests.

Under ASGI Django runs each request's sync code on a thread of its own; with
persistent connections (CONN_MAX_AGE) each such thread left its connection open,
and a burst of API calls made one web process hold 95 idle connections, so the
database refused every other client. The web process pools instead
(``GPULAB_DB_POOL``, set by portal/asgi.py; at most ``GPULAB_DB_POOL_MAX``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httpx
import pytest
from django.db import connection

from portal.api.tokens import create_token

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120), pytest.mark.web_only]

APP = "gpulab-web-under-test"
POOL_MAX = 3


def web_connections() -> int:
    """Connections the web process holds now (libpq names them by PGAPPNAME)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [APP]
        )
        return int(cursor.fetchone()[0])


async def burst(base_url: str, secret: str, n: int) -> list[int]:
    headers = {"Authorization": f"Bearer {secret}"}
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=60
    ) as client:
        got = await asyncio.gather(*(client.get("/api/v1/jobs/") for _ in range(n)))
    return [r.status_code for r in got]


@pytest.mark.web_env(
    PGAPPNAME=APP,
    GPULAB_DB_POOL_MAX=POOL_MAX,
    # the burst is about connections, not the per-token rate limit nor the caps
    # on one client's calls at once
    GPULAB_API_RATE_LIMIT=1000,
    GPULAB_WEB_API_PER_CLIENT=0,
    GPULAB_WEB_RUNNING_PER_CLIENT=0,
)
def test_a_burst_of_requests_holds_at_most_the_pools_connections(
    stack: Stack, alice: User
) -> None:
    _token, secret = create_token(alice, "burst", None)

    codes = asyncio.run(burst(stack.base_url, secret, 200))

    assert codes == [200] * 200
    held = web_connections()
    assert 1 <= held <= POOL_MAX
