"""One scheduling pass (``tasks.run_one_pass``) as a whole: it runs with Python's
cycle collector paused and leaves the collector as it found it."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING
from unittest import mock

import pytest

from scheduler import services, tasks
from tests.factories import JobFactory

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet", "send")]


@pytest.fixture
def collector_seen() -> Iterator[list[bool]]:
    """Whether the cycle collector was enabled while the pass loaded its state."""
    seen: list[bool] = []
    real = services.snapshot

    def snapshot() -> services.Snapshot:
        seen.append(gc.isenabled())
        return real()

    with mock.patch.object(services, "snapshot", side_effect=snapshot):
        yield seen
    gc.enable()


def test_a_pass_pauses_the_cycle_collector_and_resumes_it(
    alice: User, cluster: list[Node], collector_seen: list[bool]
) -> None:
    JobFactory(owner=alice)
    assert gc.isenabled()

    result = tasks.run_one_pass()

    assert result["started"] == 1
    assert collector_seen == [False]
    assert gc.isenabled()


def test_a_pass_leaves_a_paused_collector_paused(
    cluster: list[Node], collector_seen: list[bool]
) -> None:
    gc.disable()

    tasks.run_one_pass()

    assert collector_seen == [False]
    assert not gc.isenabled()


def test_a_failing_pass_resumes_the_collector(cluster: list[Node]) -> None:
    with (
        mock.patch.object(services, "snapshot", side_effect=RuntimeError("db")),
        pytest.raises(RuntimeError),
    ):
        tasks.run_one_pass()

    assert gc.isenabled()
