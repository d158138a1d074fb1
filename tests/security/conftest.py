"""The e2e ``stack`` fixture (real uvicorn, Celery worker, agents) for the
security tests that need real processes."""

from __future__ import annotations

from tests.e2e.conftest import stack

__all__ = ["stack"]
