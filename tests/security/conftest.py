"""The e2e ``stack`` fixture (real uvicorn, Celery worker, agents) for the
security tests that need real processes, and the group-leader persona of the
permission tables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import _user
from tests.e2e.conftest import stack

if TYPE_CHECKING:
    from django.contrib.auth.models import User

__all__ = ["leader", "stack"]


@pytest.fixture
def leader(groups: dict[str, Any]) -> User:
    """dora leads alice's group (vision): she sees its jobs and usage, read only."""
    from scheduler.models import Membership

    user = _user("dora", None)
    Membership.objects.create(user=user, group=groups["vision"], is_leader=True)
    return user
