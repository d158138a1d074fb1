"""Jobs, job arrays and dependencies, the queue's order and a job's history
(``JobEvent``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import connection, models
from django.db.models import BooleanField, Q
from django.db.models.expressions import RawSQL
from django.utils import timezone

from scheduler.models.accounts import Group, Membership
from scheduler.policy.predict import planned_runtime

if TYPE_CHECKING:
    from collections.abc import Iterable
    from datetime import datetime, timedelta

    from django.contrib.auth.models import AnonymousUser, User


class JobQuerySet(models.QuerySet["Job"]):
    def visible_to(self, user: User | AnonymousUser) -> JobQuerySet:
        """Jobs the user may see: their own and, for a group's leader, the jobs
        charged to that group (leaders see their group's usage and jobs, read
        only); staff see all."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self
        # The led groups as a list, not a subquery: PostgreSQL then reads the
        # owner and group indexes (a bitmap OR) instead of scanning every job
        # against a hashed subplan, which a count of a member's jobs did at
        # 100k jobs (bench/bounded_cost.py).
        led = list(
            Membership.objects.filter(user=user, is_leader=True).values_list(
                "group_id", flat=True
            )
        )
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
        return self.ahead_of_place(job.queue_order, job.submitted_at, job.pk)

    def ahead_of_place(
        self, queue_order: int, submitted_at: datetime, pk: int
    ) -> JobQuerySet:
        """The waiting jobs ahead of a placed job's keys (``QUEUE_ORDER``), the
        nearest first: ``ahead_of`` for a job read as values, not a model."""
        before = RawSQL(
            _AHEAD_SQL,
            [queue_order, submitted_at, pk],
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
    places = queue_places([(j.pk, j.queue_order, j.submitted_at) for j in placed])
    for job in placed:
        job.queue_position = places.get(job.pk)


def queue_places(placed: list[tuple[int, Any, datetime]]) -> dict[int, int]:
    """The 1-based places in the queue of waiting jobs a pass has placed, given
    as (id, queue_order, submitted_at), in at most one query: one job's count
    of the jobs ahead (the queue index), more jobs' one numbering of the whole
    queue. A job no longer waiting there has none."""
    if not placed:
        return {}
    if len(placed) == 1:
        pk, order, submitted = placed[0]
        return {pk: Job.objects.ahead_of_place(order, submitted, pk).count() + 1}
    with connection.cursor() as cursor:
        cursor.execute(_PLACES_SQL, [[pk for pk, _, _ in placed]])
        return dict(cursor.fetchall())


def restarts_of(
    attempts: Iterable[tuple[int, datetime | None, int | None]],
) -> tuple[int, int]:
    """(Times resumed, GPU-seconds of work lost) from a job's attempts as
    (number, started_at, lost_work_gpu_s): an attempt that lost work counts as
    resumed once a later attempt started (``Job.restarts``)."""
    rows = list(attempts)
    last = max((n for n, started, _ in rows if started is not None), default=0)
    resumed = sum(1 for n, _, lost in rows if lost is not None and n < last)
    return resumed, sum(lost or 0 for _, _, lost in rows)


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
    # The job saves checkpoints: a preemption sends it ``checkpoint_signal`` (TERM,
    # INT, USR1 or USR2), waits ``checkpoint_grace_s``, then SIGKILLs it, and the
    # job is requeued; only the work since its last checkpoint is lost
    # (``Attempt.lost_work_gpu_s``). Other stops use SIGTERM and ``kill_grace_s``.
    checkpointable = models.BooleanField(default=False)
    checkpoint_signal = models.CharField(max_length=8, default="TERM")
    checkpoint_grace_s = models.PositiveIntegerField(default=60)

    class Interactive(models.TextChoices):
        BATCH = "", "batch"
        JUPYTER = "jupyter", "JupyterLab"
        SHELL = "shell", "terminal"

    # An interactive job (docs/interactive.md): the product generates its command
    # and runs it in the interactive class; "" is a batch job.
    interactive = models.CharField(
        max_length=8, choices=Interactive.choices, default="", blank=True
    )
    # The secret the portal's proxy presents to the job's JupyterLab (sent to the
    # node in the launch, never shown on a page, in the API or to the browser).
    interactive_token = models.CharField(max_length=64, blank=True, editable=False)

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

    # A task of a job array: its array and index (GPULAB_ARRAY_INDEX in
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
            # The completed jobs of a run-time prediction's pool of few runs
            # (GPULAB_PREDICTION=pools: a time limit, a label, a GPU count).
            models.Index(
                fields=["time_limit_s", "workload", "gpus"],
                condition=Q(status="completed"),
                name="scheduler_job_done_pool_idx",
            ),
        ]
        # Per-action permissions of the admin console (superusers have them all).
        permissions: ClassVar = [
            ("cancel_any_job", "Can cancel any user's job"),
            ("hold_job", "Can hold and release any user's job"),
            ("requeue_job", "Can requeue a running job"),
            ("change_job_priority", "Can change the priority class of a waiting job"),
            # Opening another user's interactive job (JupyterLab, a terminal)
            # through the portal; every opening is recorded as a job event.
            ("open_any_interactive", "Can open any user's interactive job"),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.name}"

    def restarts(self) -> tuple[int, int]:
        """(How many times it was resumed, the work its requeued attempts lost in
        GPU-seconds): an attempt stopped to be requeued records what it lost
        (``Attempt.lost_work_gpu_s``); it counts as resumed once a later attempt
        started. One query on the first call (kept), none for a job that never
        had a second attempt, and none when the job was read with its attempts
        (``Prefetch("attempt_set", to_attr="attempt_list")``, as the API's job
        lists read it)."""
        if not self.preemptions and self.attempts < 2:
            return 0, 0
        cached: tuple[int, int] | None = getattr(self, "_restarts", None)
        if cached is not None:
            return cached
        read = getattr(self, "attempt_list", None)
        rows = (
            [(a.number, a.started_at, a.lost_work_gpu_s) for a in read]
            if read is not None
            else list(
                self.attempt_set.values_list("number", "started_at", "lost_work_gpu_s")
            )
        )
        self._restarts = restarts_of(rows)
        return self._restarts

    @property
    def checkpoint_summary(self) -> str:
        """ "resumed 2 times, 14 min of work lost" (minutes on its GPUs): the job
        page's line; ``gpulab show`` words the API's numbers the same way."""
        resumed, lost = self.restarts()
        minutes = round(lost / max(1, self.gpus) / 60)
        times = "1 time" if resumed == 1 else f"{resumed} times"
        return f"resumed {times}, {minutes} min of work lost"

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
    """One submission of many tasks: ``size`` ``Job`` rows, each with its
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
