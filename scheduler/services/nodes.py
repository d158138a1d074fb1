"""Admin verbs on nodes and their GPUs: register a node, rotate its agent token,
set how many jobs a GPU may run at once."""

from __future__ import annotations

import logging
import re
from functools import partial
from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction

from scheduler import events
from scheduler.models import Allocation, Gpu, Node
from scheduler.services.common import _pass_after_commit

if TYPE_CHECKING:
    from django.contrib.auth.models import User

log = logging.getLogger(__name__)

# The most jobs one GPU may run at once, unless GPULAB_GPU_JOB_LIMIT (the slots
# a GPU gets when its agent first reports it) is set higher.
MAX_GPU_SLOTS = 16


def check_node_name(name: str) -> str:
    """The name stripped, if a node may be called so (what ``create_node``
    checks; the console's form shows it); else a ``ValidationError`` keyed
    ``name``."""
    name = name.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ValidationError(
            {"name": "Use 1-63 letters, digits, dots, dashes or underscores."}
        )
    return name


def create_node(name: str) -> tuple[Node, str]:
    """Register a node; return it and its token (shown once, stored hashed)."""
    name = check_node_name(name)
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


def max_gpu_slots() -> int:
    """The most slots a GPU may be given (``MAX_GPU_SLOTS``, or the default
    ``GPULAB_GPU_JOB_LIMIT`` where that is higher)."""
    return max(MAX_GPU_SLOTS, settings.GPULAB_GPU_JOB_LIMIT)


def check_gpu_slots(gpu: Gpu, slots: int) -> None:
    """Whether ``gpu`` may take ``slots`` now: from 1 to ``max_gpu_slots()``, and
    no fewer than its live allocations hold (an exclusive job holds every slot,
    a shared one slot ``n``, so a GPU needs ``n + 1`` slots while it runs).
    Raises ``ValidationError`` keyed ``slots`` naming the jobs in the way; the
    same check the console's form shows and ``set_gpu_slots`` makes under the
    GPU's lock."""
    top = max_gpu_slots()
    if not 1 <= slots <= top:
        raise ValidationError({"slots": f"A GPU has from 1 to {top} slots."})
    held = list(
        Allocation.objects.filter(gpu=gpu, released_at__isnull=True, slot__gte=slots)
        .order_by("slot")
        .values_list("slot", "attempt__job_id")
    )
    if held:
        needed = held[-1][0] + 1
        jobs = ", ".join(f"slot {slot} by job #{job}" for slot, job in held)
        raise ValidationError(
            {
                "slots": f"At least {needed} while running jobs hold its slots"
                f" ({jobs}); lower it once they end."
            }
        )


def set_gpu_slots(gpu_id: int, slots: int, *, by: User | None) -> bool:
    """Set how many jobs the GPU may run at once (``Gpu.slots``). Returns whether
    it changed.

    1. ``by`` (the admin in the console) needs ``scheduler.change_gpu``
       (``PermissionDenied`` else); None: gpulab itself.
    2. Lock the GPU: a start locks the GPUs it takes, so no slot is allocated
       while this checks and writes. Check the value (``check_gpu_slots``:
       ``ValidationError``, nothing written).
    3. Write it, the GPU's admin history under ``by``'s name ("slots 2 -> 4"),
       one log line, and a pass after commit: the cluster's capacity changed.
    """
    if by is not None and not by.has_perm("scheduler.change_gpu"):
        raise PermissionDenied("Changing a GPU's slots needs change_gpu.")
    with transaction.atomic():
        gpu = (
            Gpu.objects.select_for_update(of=("self",))
            .select_related("node")
            .get(pk=gpu_id)
        )
        old = gpu.slots
        if slots == old:
            return False
        check_gpu_slots(gpu, slots)
        gpu.slots = slots
        gpu.save(update_fields=["slots"])
        if by is not None:
            LogEntry.objects.log_actions(
                user_id=by.pk,
                queryset=[gpu],
                action_flag=CHANGE,
                change_message=f"slots {old} -> {slots}",
                single_object=True,
            )
        _pass_after_commit()
    log.info(
        "GPU %s:%d now has %d slot(s) (was %d), set by %s",
        gpu.node.name,
        gpu.index,
        slots,
        old,
        by.get_username() if by is not None else "gpulab",
    )
    return True
