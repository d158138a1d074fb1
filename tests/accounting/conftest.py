"""Usage fixtures shared by the accounting tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node


@pytest.fixture
def usage(alice: User, bob: User, charlie: User, cluster: list[Node]) -> None:
    """Usage of alice, bob (vision) and charlie (nlp).

    On T0's day: alice 2 GPU-hours (2 GPUs, 1 h), bob 0.5, charlie (nlp) 1."""
    from tests.accounting.test_charges import T0, end, run_alone
    from tests.factories import JobFactory

    node_a, node_b = cluster
    runs = [
        (run_alone(JobFactory(owner=owner, gpus=gpus), node, T0), seconds, node)
        for owner, gpus, seconds, node in (
            (alice, 2, 3600, node_a),
            (bob, 1, 1800, node_a),
            (charlie, 1, 3600, node_b),
        )
    ]
    for attempt, seconds, node in runs:
        end(node, attempt, T0 + seconds)
