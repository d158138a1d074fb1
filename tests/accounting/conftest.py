"""The service tests' mocks of on-commit side effects (agent frames, broadcasts,
the next pass), shared with tests/scheduler."""

from __future__ import annotations

from tests.scheduler.conftest import quiet, send

__all__ = ["quiet", "send"]
