"""Quota tests reuse the service tests' mocks of on-commit side effects."""

from __future__ import annotations

from tests.scheduler.conftest import quiet, send

__all__ = ["quiet", "send"]
