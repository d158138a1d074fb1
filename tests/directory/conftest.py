"""The real OpenLDAP server of the directory tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.directory.slapd import Slapd, start_slapd

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture
def slapd(tmp_path: Path) -> Iterator[Slapd]:
    """A freshly seeded slapd per test (a test changes its directory)."""
    server = start_slapd(tmp_path / "slapd")
    try:
        yield server
    finally:
        server.stop()
