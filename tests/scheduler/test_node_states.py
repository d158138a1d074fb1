"""A node's state has one writer, ``services.set_node_status``: a hello brings a
node UP, silence makes it LOST; any other change is refused and writes nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from scheduler import services
from scheduler.models import Node
from scheduler.services.presence import NODE_TRANSITIONS
from tests.conftest import hello_data

pytestmark = pytest.mark.django_db

N = Node.Status


def test_the_node_states_allowed() -> None:
    assert {
        (N.NEW, N.UP),
        (N.UP, N.UP),
        (N.LOST, N.UP),
        (N.UP, N.LOST),
    } == NODE_TRANSITIONS


def test_a_node_that_never_said_hello_is_not_lost() -> None:
    node, _ = services.create_node("n1")

    with pytest.raises(ValueError, match="new -> lost"), transaction.atomic():
        services.set_node_status(node, N.LOST, connected=False)

    node.refresh_from_db()
    assert node.status == N.NEW


def test_a_node_goes_up_lost_and_up_again_through_its_writer() -> None:
    node, _ = services.create_node("n1")
    services.record_hello(node.pk, hello_data(1, host="n1"))
    node.refresh_from_db()
    assert (node.status, node.connected, node.hostname) == (N.UP, True, "n1")

    lost = services.mark_lost_nodes(timezone.now() + timedelta(hours=1))

    node.refresh_from_db()
    assert lost == [node.pk]
    assert (node.status, node.connected) == (N.LOST, False)
    services.record_hello(node.pk, hello_data(1, host="n1"))
    node.refresh_from_db()
    assert (node.status, node.connected) == (N.UP, True)
