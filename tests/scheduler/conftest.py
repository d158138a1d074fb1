"""Fixtures shared by the service tests: the side effects a service verb triggers
on commit (agent frames, browser broadcasts, the next pass) replaced by mocks, so a
test can assert on them and nothing reaches Redis or Celery."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest


@pytest.fixture
def send() -> Any:
    """``events.send_to_agent``: the frames sent to node agents."""
    with mock.patch("scheduler.events.send_to_agent", autospec=True) as send:
        yield send


@pytest.fixture
def quiet() -> Any:
    """No browser broadcasts and no queued scheduling pass."""
    with (
        mock.patch("scheduler.events.broadcast_job_status", autospec=True),
        mock.patch("scheduler.tasks.schedule_pass.delay", autospec=True),
    ):
        yield
