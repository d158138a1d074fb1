"""Fixtures for the developer stack's tests: short state dirs (Unix socket paths are
limited to ~107 characters) and a guarantee that servers started here are stopped."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def short_state_dir() -> Iterator[Path]:
    """A fresh state dir with a short path under /tmp (not pytest's long tmp_path)."""
    path = Path(tempfile.mkdtemp(prefix="gls-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
