"""Admin verbs on nodes: register one, rotate its agent token."""

from __future__ import annotations

import re
from functools import partial

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from scheduler import events
from scheduler.models import Node


def create_node(name: str) -> tuple[Node, str]:
    """Register a node; return it and its token (shown once, stored hashed)."""
    name = name.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ValidationError(
            {"name": "Use 1-63 letters, digits, dots, dashes or underscores."}
        )
    token = Node.new_token()
    node = Node(name=name)
    node.set_token(token)
    try:
        with transaction.atomic():
            node.save()
    except IntegrityError:
        raise ValidationError({"name": f"A node named {name!r} exists."}) from None
    return node, token


def rotate_node_token(node_id: int) -> str:
    """Give the node a new token; the old one stops working at once: no new
    connection with it, and the live one (if any) is closed after commit."""
    token = Node.new_token()
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        node.set_token(token)
        node.save(update_fields=["token_hash"])
        transaction.on_commit(
            partial(events.revoke_agent_token, node.pk, node.token_hash)
        )
    return token
