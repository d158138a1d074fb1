"""Fixtures for the node agent tests: no Django, no database, no GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from agent_helpers import Portal

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def portal() -> AsyncIterator[Portal]:
    server = Portal()
    await server.start()
    yield server
    await server.stop()
