"""GPU machines and their GPUs, the agent's token, and what each agent last
said it holds (the reconciler's evidence)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta
from typing import ClassVar, Final, Literal

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

# What an admin may do to a node (the console, the node page, the API): drain and
# maintenance each keep it from taking new jobs while running ones finish
# (maintenance also says why: an admin works on it); resume clears both.
NodeModeVerb = Literal["drain", "maintenance", "resume"]
NODE_MODE_VERBS: Final[tuple[NodeModeVerb, ...]] = ("drain", "maintenance", "resume")


def node_mode(*, draining: bool, maintenance: bool) -> str:
    """The mode a node's flags show: "maintenance" (it says why, so it wins),
    "draining", or "" (it takes jobs if it is up)."""
    if maintenance:
        return "maintenance"
    return "draining" if draining else ""


def mode_flags(verb: str, *, draining: bool, maintenance: bool) -> tuple[bool, bool]:
    """The (draining, maintenance) flags ``verb`` leaves on a node that has these;
    ValueError for a verb not in ``NODE_MODE_VERBS``."""
    if verb == "drain":
        return True, maintenance
    if verb == "maintenance":
        return draining, True
    if verb == "resume":
        return False, False
    raise ValueError(f"Unknown node mode {verb!r}.")


def hash_token(token: str) -> str:
    """SHA-256 of a node token. Tokens are 256-bit random, so no slow hash is needed."""
    return hashlib.sha256(token.encode()).hexdigest()


class NodeQuerySet(models.QuerySet["Node"]):
    def schedulable(self) -> NodeQuerySet:
        return self.filter(status=Node.Status.UP, draining=False, maintenance=False)

    def needing_attention(self) -> NodeQuerySet:
        """Lost, draining or in maintenance: what an admin should look at."""
        return self.filter(
            Q(status=Node.Status.LOST) | Q(draining=True) | Q(maintenance=True)
        )


class Node(models.Model):
    """A GPU machine running the agent.

    States::

        NEW --hello--> UP --no heartbeat for GPULAB_NODE_LOST_AFTER--> LOST
                        ^                                               |
                        +-------------------- hello --------------------+

    ``draining`` and ``maintenance`` are orthogonal to the status: either keeps a
    node from taking new jobs (running ones finish). Draining is "let it empty";
    maintenance says why (an admin works on it) and is shown as such; resume
    clears both (``services.set_node_mode``).
    """

    class Status(models.TextChoices):
        NEW = "new", "never connected"
        UP = "up", "up"
        LOST = "lost", "lost"

    name = models.CharField(
        max_length=63,
        unique=True,
        help_text="Usually the machine's host name.",
    )
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    status = models.CharField(
        max_length=8, choices=Status.choices, default=Status.NEW, db_index=True
    )
    draining = models.BooleanField(default=False)
    # In maintenance: takes no new jobs and is shown as such (set by admins).
    maintenance = models.BooleanField(default=False)
    hostname = models.CharField(max_length=255, blank=True)
    driver_version = models.CharField(max_length=64, blank=True)
    cuda_version = models.CharField(max_length=64, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)
    incarnation = models.CharField(max_length=64, blank=True)
    connected = models.BooleanField(default=False)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ("name",)
        permissions: ClassVar = [
            ("drain_node", "Can drain, resume and put nodes in maintenance"),
            ("rotate_node_token", "Can rotate a node's agent token"),
        ]

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(32)

    def set_token(self, token: str) -> None:
        self.token_hash = hash_token(token)

    def check_token(self, token: str) -> bool:
        return hmac.compare_digest(self.token_hash, hash_token(token))

    @property
    def takes_jobs(self) -> bool:
        """Up, and neither draining nor in maintenance."""
        return self.status == self.Status.UP and not (self.draining or self.maintenance)

    @property
    def mode(self) -> str:
        """What the admin set: "maintenance", "draining" or "" (``node_mode``)."""
        return node_mode(draining=self.draining, maintenance=self.maintenance)

    def apply_mode(self, verb: str) -> bool:
        """Set the flags ``verb`` leaves (``mode_flags``), unsaved; whether they
        changed."""
        before = (self.draining, self.maintenance)
        after = mode_flags(verb, draining=self.draining, maintenance=self.maintenance)
        self.draining, self.maintenance = after
        return after != before

    def is_stale(self, now: datetime) -> bool:
        if self.last_seen_at is None:
            return False
        return now - self.last_seen_at > timedelta(
            seconds=settings.GPULAB_NODE_LOST_AFTER
        )


class Gpu(models.Model):
    """One GPU of a node, as reported by its agent's ``hello``.

    ``slots`` is how many jobs may share it; an exclusive job takes every slot.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=128)
    name = models.CharField(max_length=128)
    memory_total_mib = models.PositiveIntegerField()
    nvlink_peers = models.JSONField(default=list, blank=True)
    # [{"peer": index, "level": NVML common-ancestor level}] (agents.protocol).
    topology = models.JSONField(default=list, blank=True)
    slots = models.PositiveSmallIntegerField(default=1)
    mig_enabled = models.BooleanField(default=False)
    # False when the GPU vanished from the node's last hello or fell off the bus.
    present = models.BooleanField(default=True)
    # Latest sample (agents.protocol.GpuSample as a dict) and when it was taken.
    latest = models.JSONField(default=dict, blank=True)
    latest_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("node__name", "index")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["node", "index"], name="%(app_label)s_%(class)s_unique_index"
            ),
            models.UniqueConstraint(
                fields=["uuid"], name="%(app_label)s_%(class)s_unique_uuid"
            ),
            models.CheckConstraint(
                condition=Q(slots__gte=1), name="%(app_label)s_%(class)s_slots_gte_1"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.index} ({self.name})"

    @property
    def schedulable(self) -> bool:
        return self.present and not self.mig_enabled

    @property
    def unschedulable_reason(self) -> str:
        if not self.present:
            return "GPU lost"
        if self.mig_enabled:
            return "MIG mode enabled (not supported yet)"
        return ""


class AgentReport(models.Model):
    """When a node's agent last listed the attempts it holds (every heartbeat and
    hello); the list itself is the node's ``AgentSighting`` rows refreshed at that
    instant (``last_seen_at == reported_at``). Read by the reconciler."""

    node = models.OneToOneField(
        Node, on_delete=models.CASCADE, primary_key=True, related_name="report"
    )
    reported_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.node_id} at {self.reported_at}"


class AgentSighting(models.Model):
    """An attempt a node's agent said it holds (running, or its exit not yet
    acknowledged), and when it last said so: the reconciler's evidence
    (``services.reconcile``). ``attempt_id`` is not a foreign key: an agent may
    report an attempt the portal never made or gave to another node.

    ``stale_since`` / ``killed_at`` are the reconciler's marks for an attempt the
    agent holds although the portal ended it (or never gave it to this node):
    first noticed, then told to stop (set once by compare-and-swap, so two
    reconcilers write one event)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="sightings")
    attempt_id = models.BigIntegerField()
    first_seen_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    stale_since = models.DateTimeField(null=True, blank=True)
    killed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["node", "attempt_id"], name="%(app_label)s_%(class)s_unique"
            )
        ]
        indexes: ClassVar = [models.Index(fields=["attempt_id"])]

    def __str__(self) -> str:
        return f"attempt {self.attempt_id} on node {self.node_id}"


class PortalHearing(models.Model):
    """Whether the portal can hear its agents: one row, pulsed every few seconds
    by every web process (``services.presence.pulse_hearing``) while it serves.

    ``heard_at`` is the last pulse; ``hearing_since`` the start of the current
    unbroken run of pulses (a pulse after a gap longer than
    ``presence.hearing_gap``, half of ``GPULAB_NODE_LOST_AFTER``, starts a new
    run). A node is judged lost only on
    time the portal could hear it: ``services.mark_lost_nodes`` counts a node's
    silence from the later of its last heartbeat and ``hearing_since``, and
    judges nobody while the pulse is older than the gap."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    heard_at = models.DateTimeField()
    hearing_since = models.DateTimeField()

    class Meta:
        constraints: ClassVar = [
            models.CheckConstraint(
                condition=Q(id=1), name="%(app_label)s_%(class)s_singleton"
            )
        ]

    def __str__(self) -> str:
        return f"hearing since {self.hearing_since} (last pulse {self.heard_at})"
