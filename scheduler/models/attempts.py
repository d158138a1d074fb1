"""A job's starts on nodes: attempts, the GPU slots they hold, their progress
history and their output."""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

from django.db import models
from django.db.models import Q
from django.utils import timezone

from scheduler.models.jobs import Job
from scheduler.models.nodes import Gpu, Node


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
    # When its ``job.kill`` was last sent (set with ``kill_reason``), and how many
    # times ``services.resend_kills`` sent it again because no exit came back.
    kill_sent_at = models.DateTimeField(null=True, blank=True)
    kill_resends = models.PositiveIntegerField(default=0)
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
    # When the job last printed a ``GPULAB_CHECKPOINT`` line (as its output
    # reached the portal), and, for an attempt stopped to be requeued (preempted,
    # requeued, evicted), the work it lost in GPU-seconds: from its last
    # checkpoint (a checkpointable job that printed one) or its start to its end,
    # times its GPUs. Null: nothing lost (it was not requeued). Where the
    # scheduler or an admin stopped it (``checkpoints.UNCHARGED_STOPS``), where
    # that lost run starts (``lost_since``): the charging rule charges its run up
    # to there and keeps the rest as lost work, charged to nobody
    # (``UsageRecord.lost_gpu_seconds``); null: all of its run is charged.
    checkpoint_at = models.DateTimeField(null=True, blank=True)
    lost_work_gpu_s = models.PositiveIntegerField(null=True, blank=True)
    lost_since = models.DateTimeField(null=True, blank=True)
    # The waiting job a preemption stops it for (set with ``kill_reason``
    # "preempted"): the queue and the job page say whom it yields to.
    preempted_for = models.ForeignKey(
        Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Started as a guest (``GPULAB_GUEST_BACKFILL``): on GPUs reserved for the
    # first job waiting, past its planned start; it yields them (preempted, its
    # work kept to its last checkpoint) when that job can start.
    guest = models.BooleanField(default=False)
    # An interactive attempt's server on its node (as the agent reported it in
    # job.started): where the portal's proxy forwards, and the command that ran.
    interactive_host = models.CharField(max_length=255, blank=True)
    interactive_port = models.PositiveIntegerField(null=True, blank=True)
    interactive_command = models.CharField(max_length=1024, blank=True)
    # The Unix account it runs as, as the agent reported it in job.started (the
    # owner's, the agent's --default-account or the agent's own); "" until then.
    run_as = models.CharField(max_length=256, blank=True)

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
        indexes: ClassVar = [
            # The most recent completed runs first: a run-time prediction's pool
            # of many runs (GPULAB_PREDICTION=pools, a common time limit) reads
            # its last few from here, not all of them.
            models.Index(
                fields=["-ended_at", "-id"],
                condition=Q(outcome="exited"),
                name="scheduler_attempt_exited_idx",
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
