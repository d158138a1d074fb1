"""The scheduler's data: lab groups, nodes and GPUs, jobs, their attempts and allocations.

Only ``scheduler.services`` writes ``Job.status``, ``Attempt`` and ``Allocation`` rows;
PostgreSQL constraints back the rules that must hold under concurrency (one job per GPU
slot, one live attempt per job, unique GPU per node index).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import connection, models
from django.db.models import BooleanField, Q
from django.db.models.expressions import RawSQL
from django.utils import timezone

from scheduler.policy.predict import planned_runtime

if TYPE_CHECKING:
    from collections.abc import Iterable

    from django.contrib.auth.models import AnonymousUser, User


class Group(models.Model):
    """A lab group: users belong to one or more; every job is charged to one."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)
    # Fair-share weight of the group (used by the policy issue).
    shares = models.PositiveIntegerField(default=1)
    members: models.ManyToManyField[Any, Any] = models.ManyToManyField(
        settings.AUTH_USER_MODEL, through="Membership", related_name="lab_groups"
    )

    class Meta:
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """A user's membership of a lab group."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    group = models.ForeignKey(Group, on_delete=models.CASCADE)
    shares = models.PositiveIntegerField(default=1)
    joined_at = models.DateTimeField(default=timezone.now)
    # A group's leaders see its usage and its members' jobs (issue 6).
    is_leader = models.BooleanField(
        default=False, help_text="Sees the group's usage and its members' jobs."
    )

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["user", "group"], name="%(app_label)s_%(class)s_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.group}"


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
        """What the admin set: "maintenance", "draining" or "" (takes jobs)."""
        if self.maintenance:
            return "maintenance"
        return "draining" if self.draining else ""

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


class JobQuerySet(models.QuerySet["Job"]):
    def visible_to(self, user: User | AnonymousUser) -> JobQuerySet:
        """Jobs the user may see: their own and, for a group's leader, the jobs
        charged to that group (issue 6: leaders see their group's usage and
        jobs, read only); staff see all."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self
        led = Membership.objects.filter(user=user, is_leader=True).values("group_id")
        return self.filter(Q(owner=user) | Q(group_id__in=led))

    def pending(self) -> JobQuerySet:
        return self.filter(status=Job.Status.PENDING)

    def in_queue_order(self) -> JobQuerySet:
        """The waiting jobs in the last pass's order; those it has not seen yet last."""
        return self.pending().order_by(*QUEUE_ORDER)

    def ahead_of(self, job: Job) -> JobQuerySet:
        """The waiting jobs ahead of ``job`` in the queue, the nearest first (none
        if no pass has placed it)."""
        if job.queue_order is None:
            return self.none()
        before = RawSQL(
            _AHEAD_SQL,
            [job.queue_order, job.submitted_at, job.pk],
            output_field=BooleanField(),
        )
        return (
            self.pending()
            .filter(queue_order__isnull=False)
            .filter(before)
            .order_by(*(f"-{f}" for f in QUEUE_ORDER))
        )

    def active(self) -> JobQuerySet:
        return self.filter(status__in=Job.ACTIVE)


# The queue's order: the last pass's keys, then (ties, jobs no pass has placed
# yet) submission order. Every listing of the queue and every count of a place
# uses it, so a place shown matches the row's place in the list.
QUEUE_ORDER = ("queue_order", "submitted_at", "id")

# Before a job in QUEUE_ORDER: one row comparison, which the queue index serves.
_AHEAD_SQL = (
    "(scheduler_job.queue_order, scheduler_job.submitted_at, scheduler_job.id)"
    " < (%s, %s, %s)"
)
_PLACES_SQL = """
SELECT id, place FROM (
    SELECT id, row_number() OVER (ORDER BY queue_order, submitted_at, id) AS place
    FROM scheduler_job WHERE status = 'pending' AND queue_order IS NOT NULL
) AS q WHERE id = ANY(%s)
"""


def attach_queue_positions(jobs: Iterable[Job], *, first: int | None = None) -> None:
    """Set ``queue_position`` on each of ``jobs`` in at most one query.

    A place is counted when read, not stored: each start would otherwise shift,
    and rewrite, the place of every job behind it (``scheduler.queue_order``).
    One job: the waiting jobs ahead of it are counted (the queue index). More:
    one numbering of the whole queue. ``first``: ``jobs`` are consecutive rows
    of the queue in ``QUEUE_ORDER`` starting at that 1-based place (a page of
    the queue), so no query is needed.
    """
    jobs = list(jobs)
    placed = [
        j for j in jobs if j.status == Job.Status.PENDING and j.queue_order is not None
    ]
    for job in jobs:
        job.queue_position = None
    if first is not None:
        for n, job in enumerate(placed):
            job.queue_position = first + n
        return
    if not placed:
        return
    if len(placed) == 1:
        job = placed[0]
        job.queue_position = Job.objects.ahead_of(job).count() + 1
        return
    with connection.cursor() as cursor:
        cursor.execute(_PLACES_SQL, [[j.pk for j in placed]])
        places = dict(cursor.fetchall())
    for job in placed:
        job.queue_position = places.get(job.pk)


def may_cancel(user: User | AnonymousUser, *, owner_id: int) -> bool:
    """The one cancel rule for a job or an array, whatever its state: its owner,
    or an admin with ``scheduler.cancel_any_job``. Seeing a job is not enough:
    staff see every job, and a group's leader the group's jobs, read only."""
    return user.is_authenticated and (
        owner_id == user.pk or user.has_perm("scheduler.cancel_any_job")
    )


class Job(models.Model):
    """A training job submitted by a lab member.

    States (DESIGN.md "Job states"; only ``scheduler.services`` changes them)::

        PENDING -> STARTING -> RUNNING -> COMPLETED | FAILED | CANCELLED | TIMEOUT
        PENDING <-> HELD                                   (hold / release)
        PENDING | HELD -> CANCELLED
        STARTING | RUNNING -> PREEMPTED -> PENDING        (preemption)
        STARTING | RUNNING -> PENDING                      (an admin's requeue)
        STARTING | RUNNING -> PENDING | FAILED             (node lost)

    Each start is an ``Attempt``; ``attempts`` counts them.
    """

    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        HELD = "held", "held"
        STARTING = "starting", "starting"
        RUNNING = "running", "running"
        PREEMPTED = "preempted", "preempted"
        COMPLETED = "completed", "completed"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"
        TIMEOUT = "timeout", "timeout"

    ACTIVE: ClassVar = (Status.PENDING, Status.HELD, Status.STARTING, Status.RUNNING)
    ON_NODE: ClassVar = (Status.STARTING, Status.RUNNING)
    TERMINAL: ClassVar = (
        Status.COMPLETED,
        Status.FAILED,
        Status.CANCELLED,
        Status.TIMEOUT,
    )

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs"
    )
    group = models.ForeignKey(Group, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=128)
    command = models.TextField()
    workdir = models.CharField(max_length=1024)
    env = models.JSONField(default=dict, blank=True)
    gpus = models.PositiveSmallIntegerField(default=1)
    gpu_memory_mib = models.PositiveIntegerField(null=True, blank=True)
    # A required GPU model (case-insensitive part of the GPU's name), e.g. "A100".
    gpu_model = models.CharField(max_length=64, blank=True)
    time_limit_s = models.PositiveIntegerField()
    # Run time predicted at submit from similar past jobs; min(limit, prediction)
    # orders the queue (run-time factor) and, with GPULAB_BACKFILL_PLAN=prediction,
    # is what backfill plans with. Shown to the owner.
    predicted_runtime_s = models.PositiveIntegerField(null=True, blank=True)
    priority_class = models.CharField(max_length=32, default="normal")
    shareable = models.BooleanField(default=False)
    # Co-location (docs/colocation.md): a slowdown cap tighter than the class's
    # (null: the class cap), and whether the job may be sent back to the queue
    # when its GPU partner is measured over its cap.
    slowdown_cap = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(1.0)]
    )
    evictable = models.BooleanField(default=True)
    workload = models.CharField(max_length=128, blank=True)
    requeue_on_node_loss = models.BooleanField(default=True)
    kill_grace_s = models.PositiveIntegerField(default=30)

    status = models.CharField(
        max_length=16, choices=Status.choices, default=Status.PENDING
    )
    # Why a pending job waits (a scheduler.policy.Reason code) and the details.
    pending_reason = models.CharField(max_length=32, blank=True)
    pending_message = models.CharField(max_length=500, blank=True)
    # The last pass's view of a pending job: its key in the scheduling order (keys
    # increase along the order and stay put when others start: scheduler.queue_order;
    # the place itself is counted when read, ``queue_position``), its weighted
    # priority factors, and when its reservation plans to start it.
    queue_order = models.BigIntegerField(null=True, blank=True)
    priority_breakdown = models.JSONField(default=dict, blank=True)
    est_start = models.DateTimeField(null=True, blank=True)
    preemptions = models.PositiveIntegerField(default=0)
    last_preempted_at = models.DateTimeField(null=True, blank=True)
    # Who put a HELD job on hold: its owner may release only their own hold; an
    # admin's hold needs an admin (Slurm's user / admin holds).
    held_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    # Set when a cancel was asked for a job on a node; the job ends when the agent
    # confirms the process group is gone.
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    exit_code = models.IntegerField(null=True, blank=True)
    end_reason = models.CharField(max_length=200, blank=True)

    submitted_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    # A task of a job array (issue 8): its array and index (GPULAB_ARRAY_INDEX in
    # its environment at launch). Its dependencies are ``JobDependency`` rows.
    array = models.ForeignKey(
        "JobArray",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="tasks",
    )
    array_index = models.PositiveIntegerField(null=True, blank=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ("-id",)
        constraints: ClassVar = [
            models.CheckConstraint(
                condition=Q(gpus__gte=1), name="%(app_label)s_%(class)s_gpus_gte_1"
            ),
            models.CheckConstraint(
                condition=Q(time_limit_s__gte=1),
                name="%(app_label)s_%(class)s_time_limit_gte_1",
            ),
            models.CheckConstraint(
                condition=~Q(command=""), name="%(app_label)s_%(class)s_command_set"
            ),
            models.UniqueConstraint(
                fields=["array", "array_index"],
                name="%(app_label)s_%(class)s_unique_array_index",
            ),
            models.CheckConstraint(
                condition=Q(array__isnull=True, array_index__isnull=True)
                | Q(array__isnull=False, array_index__isnull=False),
                name="%(app_label)s_%(class)s_array_task_indexed",
            ),
        ]
        indexes: ClassVar = [
            models.Index(
                fields=["submitted_at", "id"],
                condition=Q(status="pending"),
                name="scheduler_job_pending_idx",
            ),
            models.Index(fields=["owner", "-id"], name="scheduler_job_owner_idx"),
            # The queue in the last pass's order (QUEUE_ORDER): its pages, and a
            # job's place counted from the jobs ahead of it.
            models.Index(
                fields=["queue_order", "submitted_at", "id"],
                condition=Q(status="pending"),
                name="scheduler_job_queue_idx",
            ),
        ]
        # Per-action permissions of the admin console (superusers have them all).
        permissions: ClassVar = [
            ("cancel_any_job", "Can cancel any user's job"),
            ("hold_job", "Can hold and release any user's job"),
            ("requeue_job", "Can requeue a running job"),
            ("change_job_priority", "Can change the priority class of a waiting job"),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.name}"

    @property
    def queue_position(self) -> int | None:
        """Its 1-based place among the waiting jobs in the last pass's order; None
        if it is not waiting or no pass has placed it yet. Counted on first read
        (one query); ``attach_queue_positions`` counts a list's in one."""
        try:
            return self._queue_position
        except AttributeError:
            attach_queue_positions([self])
            return self._queue_position

    @queue_position.setter
    def queue_position(self, value: int | None) -> None:
        self._queue_position = value

    def refresh_from_db(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.pop("_queue_position", None)  # counted again when read
        super().refresh_from_db(*args, **kwargs)

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL

    @property
    def priority(self) -> float:
        return float(sum(self.priority_breakdown.values()))

    FACTOR_ORDER: ClassVar = ("class", "age", "fairshare", "size", "runtime")

    @property
    def breakdown_items(self) -> list[tuple[str, float]]:
        """The priority factors in a fixed order (PostgreSQL's jsonb reorders keys)."""
        known = [
            (k, self.priority_breakdown[k])
            for k in self.FACTOR_ORDER
            if k in self.priority_breakdown
        ]
        rest = sorted(
            (k, v) for k, v in self.priority_breakdown.items() if k not in known
        )
        return known + [(k, v) for k, v in rest if k not in self.FACTOR_ORDER]

    @property
    def planned_runtime_s(self) -> int:
        """min(limit, prediction): what the run-time factor reads, and what backfill
        plans with when ``GPULAB_BACKFILL_PLAN`` is "prediction"."""
        return int(planned_runtime(self.time_limit_s, self.predicted_runtime_s))

    @property
    def is_cancelling(self) -> bool:
        return self.cancel_requested_at is not None and not self.is_terminal

    def can_be_seen_by(self, user: User | AnonymousUser) -> bool:
        return Job.objects.visible_to(user).filter(pk=self.pk).exists()

    def can_be_cancelled_by(self, user: User | AnonymousUser) -> bool:
        """Active, not already being cancelled, and ``user`` may cancel it
        (``may_cancel``)."""
        return (
            self.status in self.ACTIVE
            and self.cancel_requested_at is None
            and self.may_cancel(user)
        )

    def may_cancel(self, user: User | AnonymousUser) -> bool:
        return may_cancel(user, owner_id=self.owner_id)

    def can_be_held_by(self, user: User | AnonymousUser) -> bool:
        """Its owner may hold their own pending job; an admin with ``hold_job``
        any pending job."""
        return (
            self.status == self.Status.PENDING
            and self.cancel_requested_at is None
            and user.is_authenticated
            and (self.owner_id == user.pk or user.has_perm("scheduler.hold_job"))
        )

    def can_be_released_by(self, user: User | AnonymousUser) -> bool:
        """Its owner may release a hold they put on it; an admin with ``hold_job``
        any hold."""
        if self.status != self.Status.HELD or not user.is_authenticated:
            return False
        if user.has_perm("scheduler.hold_job"):
            return True
        return self.owner_id == user.pk and self.held_by_id == user.pk

    def runtime(self, now: datetime | None = None) -> timedelta | None:
        if self.started_at is None:
            return None
        end = self.finished_at or now or timezone.now()
        return end - self.started_at


class JobArray(models.Model):
    """One submission of many tasks (issue 8): ``size`` ``Job`` rows, each with its
    ``array_index`` (``GPULAB_ARRAY_INDEX`` at launch) and its own state. At most
    ``max_running`` of them run at once (the ``%N`` of ``0-99%8``), enforced by the
    pure policy's gate (``policy.arrays``). ``spec`` is the indexes as submitted,
    normalised (``services.parse_array_spec``)."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    name = models.CharField(max_length=128)
    spec = models.CharField(max_length=200)
    size = models.PositiveIntegerField()
    max_running = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("-id",)
        constraints: ClassVar = [
            models.CheckConstraint(
                condition=Q(size__gte=1), name="%(app_label)s_%(class)s_size_gte_1"
            ),
            models.CheckConstraint(
                condition=Q(max_running__isnull=True) | Q(max_running__gte=1),
                name="%(app_label)s_%(class)s_max_running_gte_1",
            ),
        ]

    def __str__(self) -> str:
        return f"array {self.pk} {self.name} [{self.spec}]"


class JobDependency(models.Model):
    """``job`` may start only once ``depends_on`` has ended, as ``kind`` asks
    (Slurm's ``--dependency``): ``afterok`` (it completed with exit 0),
    ``afternotok`` (it ended any other way: failed, cancelled, timed out) or
    ``afterany`` (it ended). Evaluated by the pure policy each pass
    (``policy.dependency``); a dependency that can never be met keeps the job
    pending with the reason ``dependency_never``."""

    class Kind(models.TextChoices):
        AFTEROK = "afterok", "afterok"
        AFTERANY = "afterany", "afterany"
        AFTERNOTOK = "afternotok", "afternotok"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="dependencies")
    depends_on = models.ForeignKey(
        Job, on_delete=models.CASCADE, related_name="dependents"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)

    class Meta:
        ordering = ("job", "depends_on")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["job", "depends_on"], name="%(app_label)s_%(class)s_unique"
            ),
            models.CheckConstraint(
                condition=~Q(job=models.F("depends_on")),
                name="%(app_label)s_%(class)s_not_self",
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} {self.kind}:{self.depends_on_id}"


class Attempt(models.Model):
    """One start of a job on a node; holds its GPU allocations.

    ``started_at`` / ``ended_at`` are the agent-reported times (authoritative for
    accounting). An attempt is live until ``ended_at`` is set; a job has at most one
    live attempt (a PostgreSQL constraint).

    Its launch, one per rank: each rank's start is in ``rank_starts`` (the first one
    is also ``started_at`` / ``pid``); launches no start came back for are re-sent
    in rounds (``launch_resends``, the last at ``launch_resent_at``) by
    ``services.resend_launches``, which gives the attempt up (``launch_lost``)
    after ``GPULAB_LAUNCH_RESENDS`` rounds.
    """

    class Outcome(models.TextChoices):
        # The agent's exit reasons (agents.protocol.ExitReason) ...
        EXITED = "exited", "exited"
        KILLED = "killed", "killed"
        NEVER_STARTED = "never_started", "never started"
        LAUNCH_FAILED = "launch_failed", "launch failed"
        LOST = "lost", "lost"
        TIMEOUT = "timeout", "timeout"
        PORT_BUSY = "port_busy", "rendezvous port busy"
        # ... and the portal's own.
        NODE_LOST = "node_lost", "node lost"
        LAUNCH_LOST = "launch_lost", "launch lost"

    # Ended without the job having run (a rank never started although its launch
    # was re-sent, or rank 0's rendezvous port was busy): the job is relaunched, at
    # most ``GPULAB_RELAUNCH_MAX`` times.
    UNLAUNCHED: ClassVar = (Outcome.PORT_BUSY, Outcome.LAUNCH_LOST)

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempt_set")
    number = models.PositiveIntegerField()
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="attempts")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    # Why the server asked the agent to stop it (cancelled, timeout, stale, ...).
    kill_reason = models.CharField(max_length=16, blank=True)
    # A job spanning nodes: the node ids in rank order (rank 0 is ``node``), and
    # each rank's exit {"<node id>": {"exit_code", "ended_at", "reason", "message"}}.
    # The attempt ends when every rank has exited. Empty for single-node attempts.
    ranks = models.JSONField(default=list, blank=True)
    rank_exits = models.JSONField(default=dict, blank=True)
    # Each rank's start as its agent reported it, single-node attempts too:
    # {"<node id>": {"started_at": epoch seconds, "pid": int}}.
    rank_starts = models.JSONField(default=dict, blank=True)
    # Rounds of re-sent launches (each re-sends every rank still silent) and when
    # the last one went; null: only the launch at ``created_at``.
    launch_resends = models.PositiveSmallIntegerField(default=0)
    launch_resent_at = models.DateTimeField(null=True, blank=True)
    # Progress the job reports (``GPULAB_PROGRESS`` lines; rank 0's node only for a
    # job spanning nodes): the latest step, total and when its line was read, and
    # where the rate window starts: the first report, or the latest one whose step
    # went backwards (the script restarted from a checkpoint). ``progress_rate()``.
    progress_step = models.BigIntegerField(null=True, blank=True)
    progress_total = models.BigIntegerField(null=True, blank=True)
    progress_at = models.DateTimeField(null=True, blank=True)
    progress_first_step = models.BigIntegerField(null=True, blank=True)
    progress_first_at = models.DateTimeField(null=True, blank=True)
    # Set when the attempt joined a GPU that already ran jobs: the admission
    # record (policy.colocate.Admission: rule, message, predicted slowdowns,
    # gain, confidence, trial, partners). Shown on the job page.
    admission = models.JSONField(null=True, blank=True)
    # When another job first shared its GPU (or it joined one): its solo window
    # ends there. ``solo_rate``: its steps/s alone, kept when it ends
    # (``services.interference``).
    shared_at = models.DateTimeField(null=True, blank=True)
    solo_rate = models.FloatField(null=True, blank=True)
    # What the agents measured of it: the most GPU memory its processes held on
    # one GPU (from the persisted samples, while it runs), and the mean fraction
    # of time its processes kept the GPU busy while it ran alone (0-1, kept when
    # it ends; the interference model's prior reads its workload's median).
    peak_memory_mib = models.PositiveIntegerField(null=True, blank=True)
    solo_busy = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ("job", "number")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["job", "number"], name="%(app_label)s_%(class)s_unique_number"
            ),
            models.UniqueConstraint(
                fields=["job"],
                condition=Q(ended_at__isnull=True),
                name="%(app_label)s_%(class)s_one_live_per_job",
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.number}"

    @property
    def is_live(self) -> bool:
        return self.ended_at is None

    @property
    def node_ids(self) -> list[int]:
        """Every node the attempt runs on, in rank order."""
        return [int(n) for n in self.ranks] or [self.node_id]

    def progress_rate(self) -> float | None:
        """Steps per second over the rate window: (latest step - first step) /
        (latest time - first time); None until two reports some time apart."""
        step, first_step = self.progress_step, self.progress_first_step
        at, first_at = self.progress_at, self.progress_first_at
        if step is None or first_step is None or at is None or first_at is None:
            return None
        seconds = (at - first_at).total_seconds()
        if seconds <= 0:
            return None
        return (step - first_step) / seconds

    def rank_started(self, node_id: int) -> bool:
        """Whether the rank on ``node_id`` has reported its start. A single-node
        attempt's one start is also its ``started_at``: one started before
        ``rank_starts`` existed (or by a portal process not yet restarted at
        deploy) has only that."""
        if str(node_id) in self.rank_starts:
            return True
        return not self.ranks and self.started_at is not None


class ProgressSample(models.Model):
    """A job's reported step over time, at most one row per attempt per ``EVERY``:
    the history a later analysis of co-location reads (speed alone versus shared).
    The latest report is on the ``Attempt`` itself."""

    EVERY: ClassVar = timedelta(seconds=60)

    attempt = models.ForeignKey(
        Attempt, on_delete=models.CASCADE, related_name="progress_samples"
    )
    at = models.DateTimeField()
    step = models.BigIntegerField()

    class Meta:
        ordering = ("attempt", "at")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["attempt", "at"], name="%(app_label)s_%(class)s_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.attempt} step {self.step} at {self.at:%Y-%m-%d %H:%M:%S}"


class Allocation(models.Model):
    """One slot of one GPU held by a live attempt.

    The partial unique constraint on (gpu, slot) is what makes a double allocation
    impossible, whatever the scheduler does.
    """

    attempt = models.ForeignKey(
        Attempt, on_delete=models.CASCADE, related_name="allocations"
    )
    gpu = models.ForeignKey(Gpu, on_delete=models.PROTECT, related_name="allocations")
    slot = models.PositiveSmallIntegerField()
    allocated_at = models.DateTimeField(default=timezone.now)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["gpu", "slot"],
                condition=Q(released_at__isnull=True),
                name="%(app_label)s_%(class)s_one_job_per_slot",
            ),
            models.UniqueConstraint(
                fields=["attempt", "gpu", "slot"],
                name="%(app_label)s_%(class)s_unique_in_attempt",
            ),
        ]
        indexes: ClassVar = [
            models.Index(
                fields=["gpu"],
                condition=Q(released_at__isnull=True),
                name="scheduler_alloc_live_idx",
            ),
            # A GPU's allocations released since a time (running attempts'
            # neighbours: portal.accounting.live), whatever the GPU's history.
            models.Index(
                fields=["gpu", "released_at"], name="scheduler_alloc_released_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.gpu} slot {self.slot} for {self.attempt}"


class JobEvent(models.Model):
    """One line of a job's history: every state transition and notable event."""

    class Source(models.TextChoices):
        USER = "user", "user"
        SCHEDULER = "scheduler", "scheduler"
        AGENT = "agent", "agent"
        SYSTEM = "system", "system"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    source = models.CharField(max_length=16, choices=Source.choices)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    from_status = models.CharField(max_length=16, blank=True)
    to_status = models.CharField(max_length=16, blank=True)
    message = models.CharField(max_length=500)

    class Meta:
        ordering = ("at", "id")
        indexes: ClassVar = [models.Index(fields=["job", "at"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.message}"


class JobLogChunk(models.Model):
    """A piece of a job's output shipped by the agent (deduplicated by offset)."""

    attempt = models.ForeignKey(
        Attempt, on_delete=models.CASCADE, related_name="log_chunks"
    )
    # The node (rank) whose output this is: each rank of a job spanning nodes has
    # its own log, with its own offsets.
    node = models.ForeignKey(
        Node, on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    offset = models.BigIntegerField()
    data = models.TextField()

    class Meta:
        ordering = ("attempt", "node", "offset")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["attempt", "node", "offset"],
                name="%(app_label)s_%(class)s_unique_per_node",
            )
        ]

    def __str__(self) -> str:
        return f"{self.attempt} output at {self.offset}"


class UsageRecord(models.Model):
    """GPU-seconds charged to one attempt on one GPU, from agent-reported start to
    end (written and, when a neighbour's times change it, rewritten by
    ``portal.accounting.services``).

    ``share`` is the time-average fraction of the GPU charged to the attempt (on a
    shared GPU by declared memory or equally, ``GPULAB_SHARED_CHARGE``), so a
    GPU-second is never charged twice. ``energy_j``: the GPU's energy counter over
    the attempt times ``share`` (null where the GPU reports none);
    ``util_gpu_mean``: the GPU's mean utilisation (%) over the attempt, from the
    persisted samples. Input of fair share, quotas and the usage reports.
    """

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="usage")
    gpu = models.ForeignKey(Gpu, on_delete=models.PROTECT, related_name="+")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    group = models.ForeignKey(Group, on_delete=models.PROTECT, related_name="+")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    share = models.FloatField()
    gpu_seconds = models.FloatField()
    energy_j = models.FloatField(null=True, blank=True)
    util_gpu_mean = models.FloatField(null=True, blank=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["attempt", "gpu"], name="%(app_label)s_%(class)s_unique"
            ),
            models.CheckConstraint(
                condition=Q(gpu_seconds__gte=0),
                name="%(app_label)s_%(class)s_non_negative",
            ),
        ]
        indexes: ClassVar = [
            models.Index(fields=["group", "ended_at"]),
            models.Index(fields=["user", "ended_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.attempt} on GPU {self.gpu_id}: {self.gpu_seconds:.0f} GPU-s"


class GpuSample(models.Model):
    """One persisted reading of one GPU (every ``GPULAB_METRICS_PERSIST_INTERVAL``
    seconds; the 1 Hz stream stays live-only).

    The table is partitioned by day on ``at`` (created by a migration, kept by
    ``scheduler.metrics``): retention drops whole partitions instead of deleting rows.
    The primary key (gpu, at) is what de-duplicates samples an agent replays.
    ``processes`` holds ``[{pid, used_memory_mib, sm_util, attempt_id}]``; a process
    with no attempt is foreign (nobody scheduled it).
    """

    pk = models.CompositePrimaryKey("gpu_id", "at")
    gpu = models.ForeignKey(
        Gpu, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    at = models.DateTimeField()
    util_gpu = models.FloatField(null=True)
    util_mem = models.FloatField(null=True)
    memory_used_mib = models.IntegerField(null=True)
    temperature_c = models.FloatField(null=True)
    power_w = models.FloatField(null=True)
    sm_clock_mhz = models.IntegerField(null=True)
    pcie_rx_kib_s = models.BigIntegerField(null=True)
    pcie_tx_kib_s = models.BigIntegerField(null=True)
    ecc_uncorrected = models.BigIntegerField(null=True)
    energy_mj = models.BigIntegerField(null=True)
    lost = models.BooleanField(default=False)
    processes = models.JSONField(default=list)

    class Meta:
        managed = False  # a partitioned table: see migration 0002
        db_table = "scheduler_gpusample"

    def __str__(self) -> str:
        return f"GPU {self.gpu_id} at {self.at:%Y-%m-%d %H:%M:%S}"


class GpuRollup(models.Model):
    """Min / mean / max of a GPU's samples over one minute or one hour, kept longer
    than raw samples (``GPULAB_ROLLUP_1M_DAYS``, ``GPULAB_ROLLUP_1H_DAYS``)."""

    class Resolution(models.TextChoices):
        MINUTE = "1m", "1 minute"
        HOUR = "1h", "1 hour"

    gpu = models.ForeignKey(
        Gpu, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    resolution = models.CharField(max_length=2, choices=Resolution.choices)
    start = models.DateTimeField()
    samples = models.PositiveIntegerField()
    util_gpu_min = models.FloatField(null=True)
    util_gpu_mean = models.FloatField(null=True)
    util_gpu_max = models.FloatField(null=True)
    util_mem_mean = models.FloatField(null=True)
    memory_used_mean = models.FloatField(null=True)
    memory_used_max = models.IntegerField(null=True)
    power_mean = models.FloatField(null=True)
    power_max = models.FloatField(null=True)
    temperature_mean = models.FloatField(null=True)
    temperature_max = models.FloatField(null=True)

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["gpu", "resolution", "start"],
                name="%(app_label)s_%(class)s_unique",
            )
        ]
        indexes: ClassVar = [models.Index(fields=["resolution", "start"])]

    def __str__(self) -> str:
        return f"GPU {self.gpu_id} {self.resolution} at {self.start:%Y-%m-%d %H:%M}"


class Profile(models.Model):
    """Per-user settings of the portal: the Unix account jobs run as on the nodes."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gpulab"
    )
    unix_account = models.CharField(
        max_length=32,
        blank=True,
        help_text="The user's account on the GPU nodes; jobs run as this account. "
        "Empty: the node's default account, if it allows one.",
        validators=[
            RegexValidator(
                r"^[a-z_][a-z0-9_-]{0,30}\$?$",
                "A Unix account name: lower-case letters, digits, _ and -.",
            )
        ],
    )
    # The group a job is charged to unless its owner picks another at submit.
    primary_group = models.ForeignKey(
        Group,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Charged for the user's jobs unless another group is chosen.",
    )

    def __str__(self) -> str:
        return f"{self.user} ({self.unix_account or 'no Unix account'})"


class InterferencePair(models.Model):
    """What was learned about one ordered pair of workloads sharing a GPU: A's
    slowdown beside B (``workload_a``'s), as log slowdowns observed per sharing
    episode (count, mean, M2: ``policy.interference.Observations``), and whether
    the pass evicted a job of this pair (``harmful``: never admitted again until
    an admin resets it). Read by the snapshot into ``policy.Knowledge``."""

    workload_a = models.CharField(max_length=128)
    workload_b = models.CharField(max_length=128)
    n = models.PositiveIntegerField(default=0)
    mean_log = models.FloatField(default=0.0)
    m2 = models.FloatField(default=0.0)
    # The weak evidence: slowdowns read from per-process NVML utilisation (solo
    # busy fraction over busy fraction while shared) for episodes where a job
    # reported no progress; the model counts each at a fraction of an observation.
    util_n = models.PositiveIntegerField(default=0)
    util_mean_log = models.FloatField(default=0.0)
    util_m2 = models.FloatField(default=0.0)
    harmful = models.BooleanField(default=False)
    harmful_reason = models.CharField(max_length=500, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    reset_at = models.DateTimeField(null=True, blank=True)
    reset_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        ordering = ("workload_a", "workload_b")
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["workload_a", "workload_b"],
                name="%(app_label)s_%(class)s_unique_pair",
            ),
            models.CheckConstraint(
                condition=Q(m2__gte=0) & Q(util_m2__gte=0),
                name="%(app_label)s_%(class)s_m2_non_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workload_a or '(unlabelled)'} beside {self.workload_b or '(unlabelled)'}"

    @property
    def slowdown(self) -> float | None:
        """The mean observed slowdown (geometric), None before any observation."""
        return math.exp(self.mean_log) if self.n else None


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
