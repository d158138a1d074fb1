"""The verbs of the scheduler: the only code that writes job state and allocations.

Each service validates, writes inside one ``transaction.atomic()`` with the job row
locked (``select_for_update``), records a ``JobEvent``, and only after commit enqueues
tasks or sends websocket messages (``transaction.on_commit``). Views, tasks, consumers
and management commands are adapters around these functions.
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, F, Func, IntegerField, Q, Sum
from django.utils import timezone

from agents import protocol
from scheduler import classes, events, policy
from scheduler import metrics as metrics_store
from scheduler.models import (
    Allocation,
    Attempt,
    Gpu,
    Group,
    Job,
    JobEvent,
    JobLogChunk,
    Membership,
    Node,
    Profile,
    UsageRecord,
    hash_token,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from django.contrib.auth.models import User

log = logging.getLogger(__name__)

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES",)
RESERVED_ENV_PREFIX = "GPULAB_"
# Simulator profile variables a job may set (agents/simulate.py reads them).
ALLOWED_GPULAB_ENV = ("GPULAB_SIM_UTIL", "GPULAB_SIM_MEM_MIB")


class JobStateError(Exception):
    """The job is not in a state that allows this action; ``str()`` says why."""


def _ts(value: float) -> datetime:
    return datetime.fromtimestamp(value, tz=UTC)


def _event(
    job: Job,
    message: str,
    *,
    source: str,
    actor: User | None = None,
    from_status: str = "",
    to_status: str = "",
    at: datetime | None = None,
) -> JobEvent:
    return JobEvent.objects.create(
        job=job,
        message=message[:500],
        source=source,
        actor=actor,
        from_status=from_status,
        to_status=to_status,
        at=at or timezone.now(),
    )


def _after_commit_state_change(job: Job, message: str) -> None:
    transaction.on_commit(
        partial(events.broadcast_job_status, job.pk, job.status, message)
    )


def _pass_after_commit() -> None:
    """Ask for a scheduling pass once the current transaction commits."""
    from scheduler.tasks import schedule_pass

    transaction.on_commit(schedule_pass.delay)


# ------------------------------------------------------------------ validation


def _bad_text(value: str, *, allow_newlines: bool) -> str | None:
    """Why ``value`` is not acceptable text, or None."""
    if "\x00" in value:
        return "must not contain NUL characters"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid UTF-8 text"
    allowed = {"\n", "\t", "\r"} if allow_newlines else set()
    for ch in value:
        if ch not in allowed and unicodedata.category(ch) == "Cc":
            return f"must not contain control characters (found U+{ord(ch):04X})"
    return None


@dataclass(frozen=True)
class JobRequest:
    """What a user asks for; ``validate_job_request`` checks it against the cluster."""

    name: str
    command: str
    workdir: str = ""
    env: Mapping[str, str] | None = None
    gpus: int = 1
    gpu_memory_mib: int | None = None
    time_limit_s: int | None = None
    priority_class: str = ""
    shareable: bool = False
    workload: str = ""
    group: str = ""
    kill_grace_s: int | None = None  # None: GPULAB_KILL_GRACE
    requeue_on_node_loss: bool = True
    gpu_model: str = ""  # a required GPU model, part of the GPU's name


def cluster_capacity(model: str = "") -> tuple[int, int, int]:
    """(GPUs on the largest node, GPUs in the cluster, largest GPU memory in MiB),
    counting every registered GPU that is present (nodes down now may come back),
    of the given model only when one is named."""
    usable = Gpu.objects.filter(present=True, mig_enabled=False)
    if model:
        usable = usable.filter(name__icontains=model)
    counts = list(
        usable.values("node_id").annotate(n=Count("id")).values_list("n", flat=True)
    )
    largest_mem = (
        usable.order_by("-memory_total_mib")
        .values_list("memory_total_mib", flat=True)
        .first()
    )
    return (max(counts, default=0), sum(counts), largest_mem or 0)


def gpu_models() -> list[str]:
    """The GPU models present in the cluster (for the form's choices and errors)."""
    return sorted(
        set(Gpu.objects.filter(present=True).values_list("name", flat=True).distinct())
    )


MAX_KILL_GRACE_S = 3600


def validate_job_request(req: JobRequest, username: str = "") -> dict[str, Any]:
    """Check a request; return the cleaned fields or raise a field-keyed
    ``ValidationError`` naming every problem."""
    errors: dict[str, str] = {}
    name = req.name.strip()
    if not name:
        errors["name"] = "Give the job a name."
    elif len(name) > 128:
        errors["name"] = "The name is longer than 128 characters."
    elif problem := _bad_text(name, allow_newlines=False):
        errors["name"] = f"The name {problem}."

    command = req.command.strip()
    max_bytes = settings.GPULAB_MAX_COMMAND_BYTES
    if not command:
        errors["command"] = "The command is empty."
    elif problem := _bad_text(command, allow_newlines=True):
        errors["command"] = f"The command {problem}."
    elif len(command.encode("utf-8")) > max_bytes:
        size = len(command.encode("utf-8"))
        errors["command"] = (
            f"The command is {size} bytes; the limit is {max_bytes} bytes. "
            "Put long scripts in a file and run that file."
        )

    workdir = req.workdir.strip() or settings.GPULAB_DEFAULT_WORKDIR.replace(
        "{user}", username
    )
    if problem := _bad_text(workdir, allow_newlines=False):
        errors["workdir"] = f"The working directory {problem}."
    elif not PurePosixPath(workdir).is_absolute():
        errors["workdir"] = "The working directory must be an absolute path."
    elif len(workdir) > 1024:
        errors["workdir"] = "The working directory path is too long."

    env = dict(req.env or {})
    for key, value in env.items():
        if not ENV_NAME_RE.match(key):
            errors["env"] = f"{key!r} is not a valid environment variable name."
            break
        if key in RESERVED_ENV or (
            key.startswith(RESERVED_ENV_PREFIX) and key not in ALLOWED_GPULAB_ENV
        ):
            errors["env"] = f"{key} is set by gpulab and cannot be overridden."
            break
        if problem := _bad_text(value, allow_newlines=True):
            errors["env"] = f"The value of {key} {problem}."
            break
    if len(env) > 200:
        errors["env"] = "At most 200 environment variables."

    pclass = classes.get_class(req.priority_class or settings.GPULAB_DEFAULT_CLASS)
    if pclass is None:
        names = ", ".join(settings.GPULAB_PRIORITY_CLASSES)
        errors["priority_class"] = (
            f"Unknown class {req.priority_class!r}; choose one of: {names}."
        )
    time_limit = req.time_limit_s
    if pclass is not None:
        if time_limit is None:
            time_limit = pclass.default_time_limit
        elif time_limit < 1:
            errors["time_limit_s"] = "The time limit must be positive."
        elif time_limit > pclass.max_time_limit:
            errors["time_limit_s"] = (
                f"The {pclass.name} class allows at most "
                f"{pclass.max_time_limit // 3600} h."
            )

    model = req.gpu_model.strip()
    _largest_node, total, largest_mem = cluster_capacity(model)
    if model and total == 0:
        known = ", ".join(gpu_models()) or "none yet"
        errors["gpu_model"] = f"No GPU matches {model!r}; the cluster has: {known}."
    elif len(model) > 64:
        errors["gpu_model"] = "The GPU model is longer than 64 characters."
    if req.gpus < 1:
        errors["gpus"] = "Ask for at least one GPU."
    elif total == 0 and not model:
        errors["gpus"] = "No GPU node has registered yet; ask an admin to add one."
    elif total == 0:
        pass  # reported on gpu_model
    elif req.gpus > total:
        which = f" matching {model!r}" if model else ""
        errors["gpus"] = f"The cluster has {total} GPU(s){which} in all."
    # A job larger than every node spans several (all or nothing, torchrun ranks).
    if req.gpu_memory_mib is not None:
        if req.gpu_memory_mib < 1:
            errors["gpu_memory_mib"] = "GPU memory must be positive."
        elif largest_mem and req.gpu_memory_mib > largest_mem:
            errors["gpu_memory_mib"] = (
                f"No GPU has that much memory; the largest has {largest_mem} MiB."
            )

    workload = req.workload.strip()
    if problem := _bad_text(workload, allow_newlines=False):
        errors["workload"] = f"The workload label {problem}."
    elif len(workload) > 128:
        errors["workload"] = "The workload label is longer than 128 characters."

    grace = settings.GPULAB_KILL_GRACE if req.kill_grace_s is None else req.kill_grace_s
    if not 0 <= grace <= MAX_KILL_GRACE_S:
        errors["kill_grace_s"] = (
            f"The grace period must be between 0 and {MAX_KILL_GRACE_S} seconds."
        )

    if errors:
        raise ValidationError(errors)
    assert pclass is not None and time_limit is not None
    return {
        "name": name,
        "command": command,
        "workdir": workdir,
        "env": env,
        "gpus": req.gpus,
        "gpu_memory_mib": req.gpu_memory_mib,
        "time_limit_s": time_limit,
        "priority_class": pclass.name,
        "shareable": req.shareable,
        "workload": workload,
        "kill_grace_s": grace,
        "requeue_on_node_loss": req.requeue_on_node_loss,
        "gpu_model": model,
    }


PREDICTION_HISTORY = 10


def predict_runtime(user_id: int, workload: str) -> int | None:
    """Run time predicted from the user's last completed jobs: the median of the
    last ``PREDICTION_HISTORY`` with the same workload label, else of any label;
    None without history (the class default then plans as the limit). One query."""
    rows = list(
        Attempt.objects.filter(
            job__owner_id=user_id,
            job__status=Job.Status.COMPLETED,
            started_at__isnull=False,
            ended_at__isnull=False,
            outcome=Attempt.Outcome.EXITED,
        )
        .order_by("-ended_at")
        .values_list("job__workload", "started_at", "ended_at")[:200]
    )
    runs = [(w, (e - s).total_seconds()) for w, s, e in rows if s and e]
    same = [d for w, d in runs if workload and w == workload]
    pool = same[:PREDICTION_HISTORY] or [d for _, d in runs[:PREDICTION_HISTORY]]
    if not pool:
        return None
    pool.sort()
    middle = len(pool) // 2
    median = pool[middle] if len(pool) % 2 else (pool[middle - 1] + pool[middle]) / 2
    return max(1, round(median))


def groups_of(user: User) -> list[Group]:
    return list(Group.objects.filter(membership__user=user).order_by("name"))


def _charge_group(user: User, name: str) -> Group:
    """The group a job is charged to: the named one (if the user is a member), else
    the user's first group; a user in no group joins the default group."""
    mine = groups_of(user)
    if name:
        for group in mine:
            if group.name == name:
                return group
        raise ValidationError({"group": f"You are not a member of group {name!r}."})
    if mine:
        return mine[0]
    group, _ = Group.objects.get_or_create(name=settings.GPULAB_DEFAULT_GROUP)
    Membership.objects.get_or_create(user=user, group=group)
    return group


# ------------------------------------------------------------------ user verbs


def submit_job(owner: User, req: JobRequest) -> Job:
    """Validate and store a new PENDING job, then ask for a scheduling pass."""
    fields = validate_job_request(req, owner.get_username())
    predicted = predict_runtime(owner.pk, fields["workload"])
    with transaction.atomic():
        group = _charge_group(owner, req.group)
        job = Job.objects.create(
            owner=owner,
            group=group,
            predicted_runtime_s=predicted,
            pending_message="waiting for the scheduler",
            **fields,
        )
        _event(
            job,
            f"submitted by {owner.get_username()}",
            source=JobEvent.Source.USER,
            actor=owner,
            to_status=job.status,
        )
        _after_commit_state_change(job, "submitted")
        _pass_after_commit()
    return job


def cancel_job(job_id: int, *, by: User) -> Job:
    """Cancel a job.

    1. Lock the job row.
    2. PENDING / HELD: it becomes CANCELLED at once.
    3. STARTING / RUNNING: record the request and, after commit, send ``job.kill``
       to its node; the job becomes CANCELLED when the agent reports the exit.
    """
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.is_terminal:
            raise JobStateError(f"Job #{job.pk} has already ended ({job.status}).")
        if job.cancel_requested_at is not None:
            raise JobStateError(f"Job #{job.pk} is already being cancelled.")
        now = timezone.now()
        who = by.get_username()
        if job.status in (Job.Status.PENDING, Job.Status.HELD):
            old = job.status
            job.status = Job.Status.CANCELLED
            job.finished_at = now
            job.cancel_requested_at = now
            job.pending_reason = job.pending_message = ""
            job.end_reason = f"cancelled by {who}"
            job.save(
                update_fields=[
                    "status",
                    "finished_at",
                    "cancel_requested_at",
                    "pending_reason",
                    "pending_message",
                    "end_reason",
                ]
            )
            _event(
                job,
                f"cancelled by {who}",
                source=JobEvent.Source.USER,
                actor=by,
                from_status=old,
                to_status=job.status,
            )
            _after_commit_state_change(job, "cancelled")
            return job
        job.cancel_requested_at = now
        job.save(update_fields=["cancel_requested_at"])
        attempt = job.attempt_set.filter(ended_at__isnull=True).first()
        _event(
            job,
            f"cancel requested by {who}; stopping the process",
            source=JobEvent.Source.USER,
            actor=by,
        )
        if attempt is not None:
            attempt.kill_reason = "cancelled"
            attempt.save(update_fields=["kill_reason"])
            _send_kill_on_commit(attempt, "cancelled", job.kill_grace_s)
        _after_commit_state_change(job, "cancelling")
    return job


def kill_frame(
    attempt_id: int, job_id: int, reason: protocol.KillReason, grace_s: int
) -> dict[str, Any]:
    return events.frame(
        protocol.JobKill,
        protocol.JobKillData(
            attempt_id=attempt_id, job_id=job_id, reason=reason, grace_s=grace_s
        ),
    )


def _send_kill_on_commit(
    attempt: Attempt,
    reason: protocol.KillReason,
    grace_s: int,
    *,
    skip: int | None = None,
) -> None:
    """After commit, ask every node of the attempt whose rank has not exited (but
    ``skip``) to stop it."""
    command = kill_frame(attempt.pk, attempt.job_id, reason, grace_s)
    for node_id in attempt.node_ids:
        if node_id == skip or str(node_id) in attempt.rank_exits:
            continue
        transaction.on_commit(partial(events.send_to_agent, node_id, command))


# ------------------------------------------------------------------ scheduling


def policy_config() -> policy.PolicyConfig:
    return policy.PolicyConfig(**settings.GPULAB_POLICY)


def class_specs() -> dict[str, policy.ClassSpec]:
    return {
        name: policy.ClassSpec(
            name=name,
            weight=c.weight,
            preemptible=c.preemptible,
            slowdown_cap=c.slowdown_cap,
        )
        for name, c in classes.all_classes().items()
    }


def decayed_usage(now: datetime) -> policy.Usage:
    """Each group's and user's GPU-seconds decayed with the fair-share half-life
    (``GPULAB_FAIRSHARE_HALF_LIFE``), running attempts counted up to ``now``, and
    their shares. Three queries, whatever the history's size."""
    half_life = float(settings.GPULAB_FAIRSHARE_HALF_LIFE)
    horizon = now - timedelta(seconds=half_life * 10)
    decay = "power(2.0, -extract(epoch from (%s - {end})) / %s)"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT g.name, u.username, sum(r.gpu_seconds * {decay.format(end="r.ended_at")})
            FROM scheduler_usagerecord r
            JOIN scheduler_group g ON g.id = r.group_id
            JOIN auth_user u ON u.id = r.user_id
            WHERE r.ended_at >= %s
            GROUP BY g.name, u.username
            UNION ALL
            SELECT g.name, u.username,
                   sum(extract(epoch from (%s - t.started_at)) / gpu.slots)
            FROM scheduler_allocation a
            JOIN scheduler_attempt t ON t.id = a.attempt_id
            JOIN scheduler_job j ON j.id = t.job_id
            JOIN scheduler_group g ON g.id = j.group_id
            JOIN auth_user u ON u.id = j.owner_id
            JOIN scheduler_gpu gpu ON gpu.id = a.gpu_id
            WHERE a.released_at IS NULL AND t.started_at IS NOT NULL
            GROUP BY g.name, u.username
            """,
            [now, half_life, horizon, now],
        )
        rows = cursor.fetchall()
    group_usage: dict[str, float] = {}
    user_usage: dict[tuple[str, str], float] = {}
    for group, user, used in rows:
        group_usage[group] = group_usage.get(group, 0.0) + float(used or 0.0)
        key = (group, user)
        user_usage[key] = user_usage.get(key, 0.0) + float(used or 0.0)
    group_shares = {g.name: float(g.shares) for g in Group.objects.all()}
    user_shares = {
        (group, user): float(shares)
        for group, user, shares in Membership.objects.values_list(
            "group__name", "user__username", "shares"
        )
    }
    return policy.Usage(group_usage, user_usage, group_shares, user_shares)


def cluster_state(now: datetime | None = None) -> policy.ClusterState:
    """Load what ``policy.decide`` needs in a fixed number of queries (never one
    per job): nodes, GPUs, live allocations, pending jobs, running attempts, usage."""
    now = now or timezone.now()
    specs = class_specs()
    nodes = list(Node.objects.all().only("id", "name", "status", "draining"))
    live = list(
        Allocation.objects.filter(released_at__isnull=True).values_list(
            "gpu_id", "attempt_id"
        )
    )
    used: dict[int, int] = {}
    gpus_of_attempt: dict[int, set[int]] = {}
    for gpu_id, attempt_id in live:
        used[gpu_id] = used.get(gpu_id, 0) + 1
        gpus_of_attempt.setdefault(attempt_id, set()).add(gpu_id)
    # Plain tuples, not model instances: building 50,000 ORM objects was most of
    # the pass at 10,000 pending jobs (bench/pass_scaling.py).
    gpu_rows = list(
        Gpu.objects.values_list(
            "pk",
            "node_id",
            "index",
            "memory_total_mib",
            "slots",
            "present",
            "mig_enabled",
            "name",
            "nvlink_peers",
            "topology",
        )
    )
    index_of = {row[0]: row[2] for row in gpu_rows}
    gpus = [
        policy.GpuView(
            id=pk,
            node_id=node_id,
            index=index,
            memory_total_mib=memory,
            slots=slots,
            free_slots=max(0, slots - used.get(pk, 0)),
            schedulable=present and not mig,
            model=name,
            nvlink_peers=tuple(int(p) for p in peers),
            topology=tuple((int(link["peer"]), int(link["level"])) for link in topo),
        )
        for (pk, node_id, index, memory, slots, present, mig, name, peers, topo) in (
            gpu_rows
        )
    ]
    pending = [
        policy.PendingJob(
            id=pk,
            gpus=n_gpus,
            gpu_memory_mib=memory,
            priority_weight=specs[pclass].weight if pclass in specs else 0.0,
            submitted_at=submitted.timestamp(),
            user=user,
            group=group,
            priority_class=pclass,
            time_limit_s=float(limit),
            planned_s=float(min(limit, predicted) if predicted else limit),
            shareable=shareable,
            gpu_model=model,
        )
        for (
            pk,
            n_gpus,
            memory,
            submitted,
            user,
            group,
            pclass,
            limit,
            predicted,
            shareable,
            model,
        ) in Job.objects.pending().values_list(
            "pk",
            "gpus",
            "gpu_memory_mib",
            "submitted_at",
            "owner__username",
            "group__name",
            "priority_class",
            "time_limit_s",
            "predicted_runtime_s",
            "shareable",
            "gpu_model",
        )
    ]
    running = []
    hour_ago = now - timedelta(hours=1)
    for (
        attempt_id,
        job_id,
        started,
        created,
        kill_reason,
        user,
        group,
        pclass,
        limit,
        predicted,
        preemptions,
        last_preempted,
    ) in Attempt.objects.filter(
        ended_at__isnull=True, pk__in=list(gpus_of_attempt)
    ).values_list(
        "pk",
        "job_id",
        "started_at",
        "created_at",
        "kill_reason",
        "job__owner__username",
        "job__group__name",
        "job__priority_class",
        "job__time_limit_s",
        "job__predicted_runtime_s",
        "job__preemptions",
        "job__last_preempted_at",
    ):
        spec = specs.get(pclass)
        running.append(
            policy.RunningJob(
                id=job_id,
                gpu_ids=tuple(
                    sorted(gpus_of_attempt[attempt_id], key=lambda g: index_of[g])
                ),
                started_at=(started or created).timestamp(),
                planned_s=float(min(limit, predicted) if predicted else limit),
                time_limit_s=float(limit),
                user=user,
                group=group,
                priority_class=pclass,
                # A job already being stopped is no candidate for preemption, and
                # its GPUs count as freeing now (no second set of victims).
                preemptible=bool(spec and spec.preemptible) and not kill_reason,
                stopping=bool(kill_reason),
                # Conservative: all its preemptions, if the last was within the hour.
                preemptions_last_hour=preemptions
                if last_preempted and last_preempted > hour_ago
                else 0,
            )
        )
    return policy.ClusterState(
        now=now.timestamp(),
        nodes=tuple(
            policy.NodeView(
                id=n.pk,
                name=n.name,
                schedulable=n.status == Node.Status.UP and not n.draining,
            )
            for n in nodes
        ),
        gpus=tuple(gpus),
        pending=tuple(pending),
        running=tuple(running),
        usage=decayed_usage(now),
        classes=specs,
        config=policy_config(),
    )


@dataclass
class ApplyResult:
    started: int = 0
    skipped: int = 0
    updated_reasons: int = 0
    preempted: int = 0


def apply_decisions(decisions: Iterable[policy.Decision]) -> ApplyResult:
    """Apply one pass's decisions.

    1. Each ``Start`` runs in its own savepoint: lock the job (must still be
       PENDING) and its GPUs (in id order, so two passes cannot deadlock), check the
       slots are free, create the attempt and one allocation per slot. A start whose
       job or GPUs changed since the state was read is skipped, not half-applied; the
       (gpu, slot) unique constraint is the last line of defence.
    2. After commit, each started attempt's ``job.launch`` goes to its node.
    3. ``Wait`` decisions update the job's reason only when it changed.
    """
    result = ApplyResult()
    decisions = list(decisions)
    with transaction.atomic():
        for decision in decisions:
            if isinstance(decision, policy.Start):
                if _start(decision):
                    result.started += 1
                else:
                    result.skipped += 1
            elif isinstance(decision, policy.Preempt) and _preempt(decision):
                result.preempted += 1
        waits = [d for d in decisions if isinstance(d, policy.Wait)]
        if waits:
            result.updated_reasons = _update_reasons(waits)
    return result


def _preempt(decision: policy.Preempt) -> bool:
    """Ask the victim's node to stop it (SIGTERM, its grace, SIGKILL); the job goes
    PREEMPTED -> PENDING when the agent reports the exit (``finish_attempt``), with
    its submit time, hence its age, kept. A victim already being stopped is left."""
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .filter(pk=decision.victim_id, status__in=Job.ON_NODE)
            .first()
        )
        if job is None or job.cancel_requested_at is not None:
            return False
        attempt = (
            Attempt.objects.select_for_update()
            .filter(job=job, ended_at__isnull=True)
            .first()
        )
        if attempt is None or attempt.kill_reason:
            return False
        attempt.kill_reason = "preempted"
        attempt.save(update_fields=["kill_reason"])
        _event(
            job,
            f"preempted for job #{decision.for_job_id}: {decision.reason}"[:500],
            source=JobEvent.Source.SCHEDULER,
        )
        _send_kill_on_commit(attempt, "preempted", job.kill_grace_s)
    return True


def _start(decision: policy.Start) -> bool:
    """Start one job on its placements (one per node, rank 0 first), all or none.

    1. Lock the job (must be PENDING) and every GPU of every placement in id order
       (two passes cannot deadlock); all must be schedulable, free, on UP nodes
       that are not draining. Anything changed since the state was read: skip.
    2. Create the attempt (``node`` = rank 0; ``ranks`` = every node, for a job
       spanning nodes) and one allocation per GPU slot.
    3. After commit, send each node its ``job.launch`` (with its rank variables).
    """
    node_ids = [p.node_id for p in decision.placements]
    wanted = {g for p in decision.placements for g in p.gpu_ids}
    try:
        with transaction.atomic():
            job = (
                Job.objects.select_for_update()
                .filter(pk=decision.job_id, status=Job.Status.PENDING)
                .first()
            )
            if job is None:
                return False
            gpus = list(
                Gpu.objects.select_for_update()
                .filter(pk__in=wanted, node_id__in=node_ids)
                .order_by("pk")
            )
            if len(gpus) != len(wanted) or not all(g.schedulable for g in gpus):
                return False
            if Allocation.objects.filter(
                gpu__in=gpus, released_at__isnull=True
            ).exists():
                return False
            nodes = Node.objects.in_bulk(node_ids)
            if len(nodes) != len(set(node_ids)) or any(
                n.status != Node.Status.UP or n.draining for n in nodes.values()
            ):
                return False
            now = timezone.now()
            job.attempts += 1
            attempt = Attempt.objects.create(
                job=job,
                number=job.attempts,
                node=nodes[node_ids[0]],
                created_at=now,
                ranks=node_ids if len(node_ids) > 1 else [],
            )
            Allocation.objects.bulk_create(
                [
                    Allocation(attempt=attempt, gpu=g, slot=slot, allocated_at=now)
                    for g in gpus
                    for slot in range(g.slots)
                ]
            )
            old = job.status
            job.status = Job.Status.STARTING
            job.pending_reason = job.pending_message = ""
            job.save(
                update_fields=[
                    "status",
                    "attempts",
                    "pending_reason",
                    "pending_message",
                ]
            )
            by_node = {n: [g for g in gpus if g.node_id == n] for n in node_ids}
            try:
                launches = [
                    (n, launch_frame(job, attempt, by_node[n], nodes)) for n in node_ids
                ]
            except ValueError as exc:  # pydantic ValidationError is a ValueError
                raise _Unlaunchable(str(exc)) from exc
            where = ", ".join(
                f"{nodes[g.node_id].name}:{g.index}"
                for n in node_ids
                for g in by_node[n]
            )
            _event(
                job,
                f"attempt {attempt.number} allocated {where}",
                source=JobEvent.Source.SCHEDULER,
                from_status=old,
                to_status=job.status,
            )
            for node_id, launch in launches:
                transaction.on_commit(partial(events.send_to_agent, node_id, launch))
            names = ", ".join(nodes[n].name for n in node_ids)
            _after_commit_state_change(job, f"starting on {names}")
            return True
    except IntegrityError:
        # Another pass took one of these slots first: the constraint held.
        log.warning("start of job %s lost a race for its GPUs", decision.job_id)
        return False
    except _Unlaunchable as exc:
        # The savepoint is rolled back (no attempt, no allocation): fail the job.
        _fail_unlaunchable(decision.job_id, str(exc))
        return False


class _Unlaunchable(Exception):
    pass


def _fail_unlaunchable(job_id: int, problem: str) -> None:
    """A job that no agent could be told to run fails with the reason, in its own
    savepoint, so one bad row never stops the pass for everyone else."""
    log.error("job %s cannot be launched: %s", job_id, problem)
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.status != Job.Status.PENDING:
            return
        job.status = Job.Status.FAILED
        job.finished_at = timezone.now()
        job.end_reason = f"cannot be launched: {problem}"[:200]
        job.save(update_fields=["status", "finished_at", "end_reason"])
        _event(
            job,
            job.end_reason,
            source=JobEvent.Source.SCHEDULER,
            from_status=Job.Status.PENDING,
            to_status=job.status,
        )
        _after_commit_state_change(job, job.end_reason)


def unix_account_of(user_id: int) -> str | None:
    """The Unix account a user's jobs run as (their profile), or None: the node
    then uses its default account, if it allows one, else refuses the job."""
    account = (
        Profile.objects.filter(user_id=user_id)
        .values_list("unix_account", flat=True)
        .first()
    )
    return account or None


# Port of the rendezvous of a multi-node job on its rank-0 node: torchrun's default
# plus a per-attempt offset, so two jobs on one node do not collide.
MASTER_PORT_BASE = 29500


def rank_env(
    attempt: Attempt, node_id: int, gpus_here: int, nodes: dict[int, Node]
) -> dict[str, str]:
    """The variables ``torchrun`` (and ``torch.distributed``'s env:// init) expect on
    one node of a job spanning nodes; empty for a single-node job."""
    ranks = attempt.node_ids
    if len(ranks) < 2:
        return {}
    master = nodes[ranks[0]]
    values = {
        "NNODES": str(len(ranks)),
        "NODE_RANK": str(ranks.index(node_id)),
        "MASTER_ADDR": master.hostname or master.name,
        "MASTER_PORT": str(MASTER_PORT_BASE + attempt.pk % 1000),
        "NPROC_PER_NODE": str(gpus_here),
    }
    env = {f"GPULAB_{k}": v for k, v in values.items()}
    env.update({k: v for k, v in values.items() if k.startswith("MASTER_")})
    env.update({f"PET_{k}": v for k, v in values.items()})  # torchrun's own names
    return env


def launch_frame(
    job: Job,
    attempt: Attempt,
    gpus: list[Gpu],
    nodes: dict[int, Node] | None = None,
) -> dict[str, Any]:
    """The ``job.launch`` for one node of the attempt (the node of ``gpus``)."""
    node_id = gpus[0].node_id if gpus else attempt.node_id
    if nodes is None and len(attempt.node_ids) > 1:
        nodes = Node.objects.in_bulk(attempt.node_ids)
    env = {str(k): str(v) for k, v in job.env.items()}
    env.update(rank_env(attempt, node_id, len(gpus), nodes or {}))
    return events.frame(
        protocol.JobLaunch,
        protocol.JobLaunchData(
            attempt_id=attempt.pk,
            attempt=attempt.number,
            job_id=job.pk,
            name=job.name,
            command=job.command,
            workdir=job.workdir,
            env=env,
            gpu_uuids=[g.uuid for g in sorted(gpus, key=lambda g: g.index)],
            grace_s=job.kill_grace_s,
            time_limit_s=job.time_limit_s,
            run_as=unix_account_of(job.owner_id),
        ),
    )


WAIT_FIELDS = (
    "pending_reason",
    "pending_message",
    "queue_position",
    "priority_breakdown",
    "est_start",
)


_UPDATE_WAITS = """
UPDATE scheduler_job AS j SET
    pending_reason = v.reason,
    pending_message = v.message,
    queue_position = v.position,
    priority_breakdown = v.breakdown::jsonb,
    est_start = v.est_start
FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::int[], %s::text[],
            %s::timestamptz[]) AS v(id, reason, message, position, breakdown, est_start)
WHERE j.id = v.id AND j.status = 'pending'
"""


def _update_reasons(waits: list[policy.Wait]) -> int:
    """Store each waiting job's reason, place, factors and planned start.

    Only rows that changed are written, in ONE statement (``UPDATE ... FROM
    unnest``): Django's ``bulk_update`` builds a CASE per field and row and took a
    minute for 10,000 jobs. Factors are rounded to 0.1 and planned starts to the
    second, so a job's growing age does not rewrite every row on every pass.
    """
    current = {
        row[0]: row[1:]
        for row in Job.objects.filter(
            pk__in=[w.job_id for w in waits], status=Job.Status.PENDING
        ).values_list("id", *WAIT_FIELDS)
    }
    rows: list[tuple[Any, ...]] = []
    for wait in waits:
        old = current.get(wait.job_id)
        if old is None:
            continue
        breakdown = {k: round(v, 1) for k, v in wait.breakdown.items()}
        est = _ts(round(wait.est_start)) if wait.est_start is not None else None
        new = (
            wait.reason.value,
            wait.message[:500],
            wait.position or None,
            breakdown,
            est,
        )
        if new != old:
            rows.append((wait.job_id, *new))
    if rows:
        columns = list(zip(*rows, strict=True))
        with connection.cursor() as cursor:
            cursor.execute(
                _UPDATE_WAITS,
                [
                    list(columns[0]),
                    list(columns[1]),
                    list(columns[2]),
                    list(columns[3]),
                    [json.dumps(b) for b in columns[4]],
                    list(columns[5]),
                ],
            )
    return len(rows)


# ------------------------------------------------------------------ agent verbs


def authenticate_node(token: str) -> Node | None:
    """The node whose token this is, or None. The lookup is by hash (unique index);
    ``check_token`` then compares in constant time."""
    if not token or len(token) > 512:
        return None
    node = Node.objects.filter(token_hash=hash_token(token)).first()
    if node is None or not node.check_token(token):
        return None
    return node


class HelloResult(NamedTuple):
    commands: list[dict[str, Any]]
    rejected: list[str]


def record_hello(node_id: int, hello: protocol.HelloData) -> HelloResult:
    """Record a node's facts and reconcile its jobs; return commands for its agent.

    1. Lock the node; update its facts; it is UP and connected.
    2. Upsert its GPUs by index; GPUs missing from the hello are marked not present.
    3. Reconcile: a live attempt of this node that the agent does not run and that
       never started is launched again (``job.launch`` is idempotent by attempt id);
       an attempt the agent runs that the portal has ended (or never made) is killed
       as stale, so a job never runs twice.
    """
    commands: list[dict[str, Any]] = []
    rejected: list[str] = []
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        now = timezone.now()
        was_lost = node.status == Node.Status.LOST
        node.status = Node.Status.UP
        node.connected = True
        node.last_seen_at = now
        node.hostname = hello.hostname[:255]
        node.driver_version = (hello.driver_version or "")[:64]
        node.cuda_version = (hello.cuda_version or "")[:64]
        node.agent_version = hello.agent_version[:64]
        node.incarnation = hello.incarnation
        node.save()
        if was_lost:
            log.info("node %s is back after being lost", node.name)

        existing = {g.index: g for g in node.gpus.all()}
        taken = dict(
            Gpu.objects.filter(uuid__in=[i.uuid for i in hello.gpus])
            .exclude(node=node)
            .values_list("uuid", "node__name")
        )
        seen = set()
        for info in hello.gpus:
            if info.uuid in taken:
                # Two nodes cannot hold one GPU: refuse it, keep the rest.
                rejected.append(
                    f"GPU {info.index} ({info.uuid}) is registered to node "
                    f"{taken[info.uuid]}"
                )
                continue
            seen.add(info.index)
            gpu = existing.get(info.index)
            if gpu is None:
                gpu = Gpu(
                    node=node, index=info.index, slots=settings.GPULAB_GPU_JOB_LIMIT
                )
            gpu.uuid = info.uuid
            gpu.name = info.name
            gpu.memory_total_mib = info.memory_total_mib
            gpu.nvlink_peers = list(info.nvlink_peers)
            gpu.topology = [link.model_dump() for link in info.topology]
            gpu.mig_enabled = info.mig_enabled
            gpu.present = True
            gpu.save()
        for index, gpu in existing.items():
            if index not in seen and gpu.present:
                gpu.present = False
                gpu.save(update_fields=["present"])

        running = {r.attempt_id for r in hello.running}
        live = list(
            Attempt.objects.filter(ended_at__isnull=True)
            .filter(Q(node=node) | Q(ranks__contains=[node.pk]))
            .select_related("job")
        )
        for attempt in live:
            if attempt.pk in running or str(node.pk) in attempt.rank_exits:
                continue
            spans = len(attempt.node_ids) > 1
            if (attempt.started_at is None or spans) and (
                attempt.job.cancel_requested_at is None
            ):
                # Never launched here (or this rank's launch was lost): launch is
                # idempotent by attempt id on the agent.
                gpus = [
                    a.gpu
                    for a in attempt.allocations.select_related("gpu").filter(
                        gpu__node=node
                    )
                ]
                unique = list({g.pk: g for g in gpus}.values())
                commands.append(launch_frame(attempt.job, attempt, unique))
            elif attempt.job.cancel_requested_at is not None:
                commands.append(
                    kill_frame(
                        attempt.pk,
                        attempt.job_id,
                        "cancelled",
                        attempt.job.kill_grace_s,
                    )
                )
        live_ids = {a.pk for a in live}
        for job in hello.running:
            if job.attempt_id not in live_ids:
                commands.append(
                    kill_frame(
                        job.attempt_id, job.job_id, "stale", settings.GPULAB_KILL_GRACE
                    )
                )
    _pass_after_commit()
    for problem in rejected:
        log.error("node %s hello: %s", node.name, problem)
    return HelloResult(commands, rejected)


def record_heartbeat(node_id: int) -> None:
    Node.objects.filter(pk=node_id).update(last_seen_at=timezone.now(), connected=True)


def record_disconnect(node_id: int) -> None:
    Node.objects.filter(pk=node_id).update(connected=False)


def record_metrics(
    node_id: int, metrics: protocol.MetricsData, *, persist: bool = False
) -> int:
    """Take one metrics frame of a node.

    1. Keep it as the latest state of each GPU (unless a newer one is stored: a
       replayed sample never overwrites the present).
    2. A GPU reported lost (fell off the bus) stops being schedulable: the node's
       capacity shrinks until a hello reports it again.
    3. With ``persist``, store it in the history (``scheduler.metrics``); a replay
       of a stored sample is ignored there.
    Samples of GPUs the node does not have (wrong index or uuid) are ignored.
    """
    at = _ts(metrics.sampled_at)
    gpus = {g.index: g for g in Gpu.objects.filter(node_id=node_id)}
    known: dict[int, int] = {}
    changed = []
    lost = []
    for sample in metrics.gpus:
        gpu = gpus.get(sample.index)
        if gpu is None or gpu.uuid != sample.uuid:
            continue
        known[sample.index] = gpu.pk
        if sample.lost and gpu.present:
            lost.append(gpu.pk)
        if gpu.latest_at is None or at >= gpu.latest_at:
            gpu.latest = sample.model_dump(mode="json")
            gpu.latest_at = at
            changed.append(gpu)
    Gpu.objects.bulk_update(changed, ["latest", "latest_at"])
    if lost:
        Gpu.objects.filter(pk__in=lost).update(present=False)
        log.error("node %s: GPU(s) %s lost (fell off the bus)", node_id, lost)
    Node.objects.filter(pk=node_id).update(last_seen_at=timezone.now())
    if persist and known:
        metrics_store.store_samples(known, metrics)
    return len(changed)


def _attempt_of_node(node_id: int, attempt_id: int, job_id: int) -> Attempt | None:
    """The attempt, locked, if this node runs it (rank 0 or another rank) for this
    job: a node cannot report for another node's jobs."""
    attempt = (
        Attempt.objects.select_for_update().filter(pk=attempt_id, job_id=job_id).first()
    )
    if attempt is None or node_id not in attempt.node_ids:
        return None
    return attempt


def mark_started(node_id: int, data: protocol.JobStartedData) -> bool:
    """The agent started the attempt: STARTING -> RUNNING. Idempotent."""
    with transaction.atomic():
        attempt = _attempt_of_node(node_id, data.attempt_id, data.job_id)
        if attempt is None or attempt.ended_at is not None:
            return False
        if attempt.started_at is not None:
            return False  # a replay
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        started = _ts(data.started_at)
        attempt.started_at = started
        attempt.pid = data.pid
        attempt.save(update_fields=["started_at", "pid"])
        old = job.status
        if job.status == Job.Status.STARTING:
            job.status = Job.Status.RUNNING
        if job.started_at is None:
            job.started_at = started
        job.save(update_fields=["status", "started_at"])
        _event(
            job,
            f"running on {attempt.node.name} (pid {data.pid})",
            source=JobEvent.Source.AGENT,
            from_status=old,
            to_status=job.status,
            at=started,
        )
        _after_commit_state_change(job, "running")
    return True


def _end_attempt(
    attempt: Attempt, ended: datetime, outcome: str, exit_code: int | None
) -> None:
    """End a live attempt: release its slots and charge its GPU time."""
    attempt.ended_at = ended
    attempt.outcome = outcome
    attempt.exit_code = exit_code
    attempt.save(update_fields=["ended_at", "outcome", "exit_code"])
    allocations = list(attempt.allocations.filter(released_at__isnull=True))
    Allocation.objects.filter(pk__in=[a.pk for a in allocations]).update(
        released_at=ended
    )
    if attempt.started_at is None:
        return
    seconds = max(0.0, (ended - attempt.started_at).total_seconds())
    slots_by_gpu: dict[int, int] = {}
    for alloc in allocations:
        slots_by_gpu[alloc.gpu_id] = slots_by_gpu.get(alloc.gpu_id, 0) + 1
    gpu_slots = dict(Gpu.objects.filter(pk__in=slots_by_gpu).values_list("pk", "slots"))
    job = attempt.job
    UsageRecord.objects.bulk_create(
        [
            UsageRecord(
                attempt=attempt,
                gpu_id=gpu_id,
                user_id=job.owner_id,
                group_id=job.group_id,
                started_at=attempt.started_at,
                ended_at=ended,
                share=held / gpu_slots[gpu_id],
                gpu_seconds=seconds * held / gpu_slots[gpu_id],
            )
            for gpu_id, held in slots_by_gpu.items()
        ],
        ignore_conflicts=True,
    )


def finish_attempt(node_id: int, data: protocol.JobExitedData) -> bool:
    """The agent reports an attempt's end. Idempotent: a duplicate is ignored.

    1. Lock the attempt (it must belong to this node and job) and the job.
    2. End the attempt: release its GPU slots, record usage from agent times.
    3. Move the job: CANCELLED if a cancel was asked; COMPLETED on exit 0; FAILED on
       a non-zero exit or a launch failure; back to PENDING (or FAILED when the job
       does not requeue) when its process was lost without an exit code.
    4. After commit: broadcast, and run a scheduling pass for the freed GPUs.
    """
    with transaction.atomic():
        attempt = _attempt_of_node(node_id, data.attempt_id, data.job_id)
        if attempt is None or attempt.ended_at is not None:
            return False
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        if len(attempt.node_ids) > 1:
            if str(node_id) in attempt.rank_exits:
                return False  # a replayed rank exit
            whole = _rank_exited(attempt, job, node_id, data)
            if whole is None:
                return True  # other ranks still run
            data = whole
        ended = _ts(data.ended_at)
        if attempt.started_at is not None and ended < attempt.started_at:
            ended = attempt.started_at
        _end_attempt(attempt, ended, data.reason, data.exit_code)
        old = job.status
        if job.status not in Job.ON_NODE:
            # The job already moved on (e.g. requeued when its node was lost).
            _event(
                job,
                f"late exit of attempt {attempt.number} ignored ({data.reason})",
                source=JobEvent.Source.AGENT,
            )
            return True
        code = data.exit_code
        server_kill = attempt.kill_reason
        if job.cancel_requested_at is not None:
            job.status = Job.Status.CANCELLED
            message = "cancelled; process stopped"
        elif server_kill == "preempted":
            _event(
                job,
                f"preempted; process stopped (exit code {code})",
                source=JobEvent.Source.AGENT,
                from_status=old,
                to_status=Job.Status.PREEMPTED,
                at=ended,
            )
            old = Job.Status.PREEMPTED
            job.status = Job.Status.PENDING
            job.preemptions += 1
            job.last_preempted_at = ended
            job.save(update_fields=["preemptions", "last_preempted_at"])
            message = "requeued after preemption (its age is kept)"
        elif data.reason == "timeout" or server_kill == "timeout":
            job.status = Job.Status.TIMEOUT
            limit = timedelta(seconds=job.time_limit_s)
            message = f"stopped at its time limit ({limit})"
        elif server_kill == "peer_failed" and data.reason in ("exited", "killed"):
            job.status = Job.Status.FAILED
            message = f"a rank failed with exit code {code}; the others were stopped"
        elif data.reason == "exited" and code == 0:
            job.status = Job.Status.COMPLETED
            message = "completed (exit code 0)"
        elif data.reason == "exited":
            # The user's program failed: a user error, not a system one.
            job.status = Job.Status.FAILED
            message = f"failed with exit code {code}"
        elif data.reason == "killed" and server_kill:
            job.status = Job.Status.FAILED
            message = f"stopped ({server_kill}), exit code {code}"
        elif data.reason == "launch_failed":
            job.status = Job.Status.FAILED
            message = f"could not be started: {data.message or 'launch failed'}"
        else:
            # lost / never_started / killed by the agent on its own (cut off from
            # the portal): a node problem, not the user's. Requeue per the job.
            what = data.message or f"process {data.reason}"
            if job.requeue_on_node_loss:
                job.status = Job.Status.PENDING
                message = f"requeued: {what} on {attempt.node.name}"
            else:
                job.status = Job.Status.FAILED
                message = f"failed: {what} on {attempt.node.name}"
        if job.status != Job.Status.PENDING:
            job.finished_at = ended
            job.exit_code = code
            job.end_reason = message
        job.save(update_fields=["status", "finished_at", "exit_code", "end_reason"])
        _event(
            job,
            message,
            source=JobEvent.Source.AGENT,
            from_status=old,
            to_status=job.status,
            at=ended,
        )
        _after_commit_state_change(job, message)
        _pass_after_commit()
    return True


def _rank_exited(
    attempt: Attempt, job: Job, node_id: int, data: protocol.JobExitedData
) -> protocol.JobExitedData | None:
    """Record one rank's exit of a job spanning nodes (attempt and job locked).

    While other ranks run, return None; if this rank failed, ask the others to stop
    (``peer_failed``): a job with a dead rank would hang in its collectives. Once
    every rank has exited, return the attempt's exit: the first failure's, else a
    clean exit at the last rank's end. A replayed rank exit changes nothing.
    """
    key = str(node_id)
    attempt.rank_exits = {**attempt.rank_exits, key: data.model_dump(mode="json")}
    attempt.save(update_fields=["rank_exits"])
    failed = data.reason != "exited" or data.exit_code != 0
    rank = attempt.node_ids.index(node_id)
    if len(attempt.rank_exits) < len(attempt.node_ids):
        if failed and not attempt.kill_reason and job.cancel_requested_at is None:
            attempt.kill_reason = "peer_failed"
            attempt.save(update_fields=["kill_reason"])
            _event(
                job,
                f"rank {rank} stopped ({data.reason}, exit code {data.exit_code}); "
                "stopping the other ranks",
                source=JobEvent.Source.AGENT,
            )
            _send_kill_on_commit(attempt, "peer_failed", job.kill_grace_s)
        return None
    exits = [
        protocol.JobExitedData.model_validate(v) for v in attempt.rank_exits.values()
    ]
    failures = sorted(
        (e for e in exits if e.reason != "exited" or e.exit_code != 0),
        key=lambda e: e.ended_at,
    )
    last = max(e.ended_at for e in exits)
    if failures:
        return failures[0].model_copy(update={"ended_at": last})
    return data.model_copy(
        update={"exit_code": 0, "reason": "exited", "ended_at": last}
    )


def append_log(node_id: int, data: protocol.JobLogData) -> bool:
    """Store a log chunk of the node's attempt, within the per-job size cap;
    a replayed chunk (same offset) is ignored."""
    attempt = (
        Attempt.objects.filter(pk=data.attempt_id, job_id=data.job_id)
        .only("id", "node_id", "ranks")
        .first()
    )
    if attempt is None or node_id not in attempt.node_ids or not data.data:
        return False
    stored = (
        JobLogChunk.objects.filter(attempt__job_id=data.job_id).aggregate(
            n=Sum(Func(F("data"), function="octet_length", output_field=IntegerField()))
        )["n"]
        or 0
    )
    if stored >= settings.GPULAB_LOG_MAX_BYTES:
        return False
    room = settings.GPULAB_LOG_MAX_BYTES - stored
    # Cut by bytes, never inside a UTF-8 sequence.
    text = data.data.encode("utf-8")[:room].decode("utf-8", "ignore")
    if not text:
        return False
    JobLogChunk.objects.bulk_create(
        [JobLogChunk(attempt=attempt, node_id=node_id, offset=data.offset, data=text)],
        ignore_conflicts=True,
    )
    return True


def log_tail(job: Job, max_chars: int = 20_000) -> str:
    """The end of a job's stored output: its attempts in order; for a job spanning
    nodes, each rank's output in turn under a ``[rank N on NODE]`` header."""
    rows = list(
        JobLogChunk.objects.filter(attempt__job=job)
        .order_by("-attempt__number", "-node_id", "-offset")
        .values_list("attempt_id", "node_id", "data")[:400]
    )
    rows.reverse()
    ranks = {
        a.pk: a.node_ids
        for a in Attempt.objects.filter(pk__in={r[0] for r in rows}).only(
            "id", "node_id", "ranks"
        )
    }
    names = dict(Node.objects.values_list("pk", "name"))
    parts: list[str] = []
    current: tuple[int, int | None] | None = None
    for attempt_id, node_id, data in sorted(
        rows,
        key=lambda r: (
            r[0],
            ranks.get(r[0], []).index(r[1]) if r[1] in ranks.get(r[0], []) else 0,
        ),
    ):
        nodes = ranks.get(attempt_id, [])
        if len(nodes) > 1 and (attempt_id, node_id) != current:
            rank = nodes.index(node_id) if node_id in nodes else "?"
            if parts and not parts[-1].endswith("\n"):
                parts.append("\n")
            parts.append(f"[rank {rank} on {names.get(node_id or 0, '?')}]\n")
        current = (attempt_id, node_id)
        parts.append(data)
    return "".join(parts)[-max_chars:]


# ------------------------------------------------------------------ liveness


def mark_lost_nodes(now: datetime | None = None) -> list[int]:
    """Mark UP nodes without a heartbeat for ``GPULAB_NODE_LOST_AFTER`` as LOST and
    requeue (or fail) their jobs, exactly once per node (row lock + status check)."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER)
    lost = []
    candidates = Node.objects.filter(
        status=Node.Status.UP, last_seen_at__lt=cutoff
    ).values_list("pk", flat=True)
    for node_id in candidates:
        with transaction.atomic():
            node = (
                Node.objects.select_for_update()
                .filter(pk=node_id, status=Node.Status.UP, last_seen_at__lt=cutoff)
                .first()
            )
            if node is None:
                continue
            node.status = Node.Status.LOST
            node.connected = False
            node.save(update_fields=["status", "connected"])
            ended = node.last_seen_at or now
            for attempt in (
                Attempt.objects.select_for_update()
                .filter(ended_at__isnull=True)
                .filter(Q(node=node) | Q(ranks__contains=[node.pk]))
            ):
                job = Job.objects.select_for_update().get(pk=attempt.job_id)
                # The job's other ranks, on nodes still up, must stop too.
                _send_kill_on_commit(
                    attempt, "node_lost", job.kill_grace_s, skip=node.pk
                )
                _end_attempt(
                    attempt,
                    max(ended, attempt.started_at or ended),
                    Attempt.Outcome.NODE_LOST,
                    None,
                )
                old = job.status
                if job.cancel_requested_at is not None:
                    job.status = Job.Status.CANCELLED
                elif job.requeue_on_node_loss:
                    job.status = Job.Status.PENDING
                else:
                    job.status = Job.Status.FAILED
                message = f"node {node.name} lost; job {job.status}"
                if job.status != Job.Status.PENDING:
                    job.finished_at = now
                    job.end_reason = message
                job.save(update_fields=["status", "finished_at", "end_reason"])
                _event(
                    job,
                    message,
                    source=JobEvent.Source.SYSTEM,
                    from_status=old,
                    to_status=job.status,
                )
                _after_commit_state_change(job, message)
            _pass_after_commit()
            lost.append(node.pk)
            log.warning("node %s marked lost (last seen %s)", node.name, ended)
    return lost


# Grace the portal gives an agent to enforce a time limit itself before it asks.
TIME_LIMIT_MARGIN = timedelta(minutes=2)


def enforce_time_limits(now: datetime | None = None) -> list[int]:
    """The portal's backstop for time limits (agents enforce them themselves, even
    cut off): ask the node to stop any attempt still running past its limit plus its
    grace and a margin. The exit then ends the job as TIMEOUT. Returns job ids."""
    now = now or timezone.now()
    overdue = []
    for attempt in Attempt.objects.filter(
        ended_at__isnull=True, started_at__isnull=False, kill_reason=""
    ).select_related("job"):
        job = attempt.job
        assert attempt.started_at is not None
        deadline = (
            attempt.started_at
            + timedelta(seconds=job.time_limit_s + job.kill_grace_s)
            + TIME_LIMIT_MARGIN
        )
        if now < deadline:
            continue
        with transaction.atomic():
            updated = Attempt.objects.filter(pk=attempt.pk, kill_reason="").update(
                kill_reason="timeout"
            )
            if not updated:
                continue  # someone else asked first (compare-and-swap)
            _event(
                job,
                "past its time limit; the portal asks its node to stop it",
                source=JobEvent.Source.SYSTEM,
            )
            _send_kill_on_commit(attempt, "timeout", job.kill_grace_s)
        overdue.append(job.pk)
    return overdue


# ------------------------------------------------------------------ admin verbs


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
    """Give the node a new token; the old one stops working at once."""
    token = Node.new_token()
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        node.set_token(token)
        node.save(update_fields=["token_hash"])
    return token


def set_draining(node_id: int, *, draining: bool) -> None:
    Node.objects.filter(pk=node_id).update(draining=draining)
    if not draining:
        _pass_after_commit()


def gpu_summary() -> dict[str, int]:
    """Headline counts for the overview page."""
    gpus = Gpu.objects.filter(present=True)
    busy = (
        Allocation.objects.filter(released_at__isnull=True)
        .values("gpu_id")
        .distinct()
        .count()
    )
    total = gpus.count()
    return {
        "gpus": total,
        "busy": busy,
        "free": max(0, total - busy),
        "running": Job.objects.filter(status=Job.Status.RUNNING).count(),
        "pending": Job.objects.filter(status=Job.Status.PENDING).count(),
        "nodes_up": Node.objects.filter(status=Node.Status.UP).count(),
        "nodes": Node.objects.count(),
        "lost": Node.objects.filter(status=Node.Status.LOST).count(),
    }
