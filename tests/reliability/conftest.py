"""Fixtures of the fault tests: the e2e ``stack`` (uvicorn, a Celery worker,
simulated agents on this run's test database; helpers in ``processes.py``).
Tests that restart PostgreSQL or Redis start private embedded servers instead
(``test_restarts.py``), never the machine's shared ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import stack

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["marker", "stack"]


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    """A file whose creation lets the tests' jobs finish (made at teardown too,
    so nothing keeps waiting)."""
    path = tmp_path / "finish"
    yield path
    path.touch()
