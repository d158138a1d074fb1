"""Admin verbs (the admin console, and an owner's own hold / release): hold and
release a waiting job, requeue a running one, change a waiting job's priority
class or its request, and put a node in drain / maintenance or back in service.

Each verb locks its row (``select_for_update``), re-checks the state under the
lock, so two admins acting at once never both act (the second gets a
``JobStateError`` naming what the first did), records a ``JobEvent`` naming who,
and only after commit broadcasts and asks for a scheduling pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied
from django.db import transaction

from scheduler import classes
from scheduler.lifecycle import Cause
from scheduler.models import Attempt, Job, JobEvent, Node, NodeModeVerb
from scheduler.services.common import (
    JobStateError,
    _event,
    _pass_after_commit,
    _send_kill_on_commit,
)
from scheduler.services.jobs import JobRequest, predict_runtime, validate_job_request
from scheduler.services.lifecycle import announce, transition

if TYPE_CHECKING:
    from collections.abc import Mapping

    from django.contrib.auth.models import User

# The verbs of ``set_node_mode`` and the flags each leaves: ``scheduler.models.nodes``.
NodeMode = NodeModeVerb


def _locked_job(job_id: int) -> Job:
    try:
        return Job.objects.select_for_update().get(pk=job_id)
    except Job.DoesNotExist:
        raise JobStateError(f"Job #{job_id} does not exist.") from None


def _state_error(job: Job, wanted: str) -> JobStateError:
    """ "Job #5 is running; only a pending job can be held." and the like."""
    if job.is_terminal:
        now = f"has ended ({job.status})"
    elif job.cancel_requested_at is not None:
        now = "is being cancelled"
    else:
        now = f"is {job.status}"
    return JobStateError(f"Job #{job.pk} {now}; {wanted}.")


def hold_job(job_id: int, *, by: User) -> Job:
    """PENDING -> HELD: the policy never sees it (the pass loads PENDING jobs
    only, and a start re-checks PENDING under the job's lock).

    1. Lock the job; it must be PENDING, and ``by`` its owner or an admin with
       ``scheduler.hold_job`` (else ``PermissionDenied``).
    2. Mark it held by ``by`` (its owner may release only their own hold), clear
       its place in the queue, one event; browsers told on commit, and a pass
       asked for (the jobs behind it may start now: it may have held the
       reservation).
    """
    with transaction.atomic():
        job = _locked_job(job_id)
        if job.status != Job.Status.PENDING:
            raise _state_error(job, "only a pending job can be held")
        if not job.can_be_held_by(by):
            raise PermissionDenied(f"You may not hold job #{job.pk}.")
        who = by.get_username()
        transition(
            job,
            Job.Status.HELD,
            Cause.HOLD,
            f"held by {who}",
            source=JobEvent.Source.USER,
            actor=by,
            notice="held",
            held_by=by,
            pending_reason="held",
            pending_message=f"held by {who}; it waits until released",
            queue_order=None,
            est_start=None,
        )
    return job


def release_job(job_id: int, *, by: User) -> Job:
    """HELD -> PENDING, with its submit time (hence its age) kept.

    1. Lock the job; it must be HELD, and ``by`` an admin with
       ``scheduler.hold_job`` or its owner releasing their own hold.
    2. PENDING again, one event; a scheduling pass after commit.
    """
    with transaction.atomic():
        job = _locked_job(job_id)
        if job.status != Job.Status.HELD:
            raise _state_error(job, "only a held job can be released")
        if not job.can_be_released_by(by):
            raise PermissionDenied(
                f"Job #{job.pk} was held by an admin; only an admin can release it."
            )
        transition(
            job,
            Job.Status.PENDING,
            Cause.RELEASE,
            f"released by {by.get_username()} (its age is kept)",
            source=JobEvent.Source.USER,
            actor=by,
            notice="released",
            held_by=None,
            pending_reason="",
            pending_message="waiting for the scheduler",
        )
    return job


def requeue_job(job_id: int, *, by: User) -> Job:
    """Send a job on a node back to the queue (an admin's verb: ``by`` needs
    ``requeue_job``, else ``PermissionDenied``).

    1. Lock the job; it must be STARTING or RUNNING and not being cancelled. A
       waiting job is already queued; an ended job is not requeued (its run, exit
       and charges stay as they were): resubmit a copy instead.
    2. Lock its live attempt; one already being stopped (preempted, evicted,
       at its time limit, or a requeue asked before) is left alone.
    3. Mark the attempt ``requeued`` and, after commit, send ``job.kill`` (SIGTERM,
       the job's grace, SIGKILL) to its nodes. The agent's exit report moves the
       job back to PENDING with its submit time, hence its age, kept
       (``finish_attempt``); a lost node requeues it the same way.
    """
    if not by.has_perm("scheduler.requeue_job"):
        raise PermissionDenied("Requeueing a job needs the requeue_job permission.")
    with transaction.atomic():
        job = _locked_job(job_id)
        if job.status not in Job.ON_NODE or job.cancel_requested_at is not None:
            if job.is_terminal:
                raise _state_error(
                    job, "an ended job is not requeued (resubmit a copy instead)"
                )
            raise _state_error(job, "only a starting or running job can be requeued")
        attempt = (
            Attempt.objects.select_for_update()
            .filter(job=job, ended_at__isnull=True)
            .first()
        )
        if attempt is None:
            raise JobStateError(f"Job #{job.pk} has no live attempt to stop.")
        if attempt.kill_reason:
            raise JobStateError(
                f"Job #{job.pk} is already being stopped ({attempt.kill_reason})."
            )
        attempt.kill_reason = "requeued"
        attempt.save(update_fields=["kill_reason"])
        _event(
            job,
            f"requeue asked by {by.get_username()}; stopping the process",
            source=JobEvent.Source.USER,
            actor=by,
        )
        _send_kill_on_commit(attempt, "requeued", job.kill_grace_s)
        announce(job, "requeueing")
    return job


def set_priority_class(job_id: int, priority_class: str, *, by: User) -> Job:
    """Move a waiting (PENDING or HELD) job to another priority class.

    1. The class must exist (``GPULAB_PRIORITY_CLASSES``) and allow the job's
       time limit; else ``ValueError`` naming the problem.
    2. Lock the job; it must be PENDING or HELD (a running job keeps the class it
       was started with: its preemptibility and caps were decided by it).
    3. Save, one event naming the old and new class; a pass after commit (the
       class weighs in its priority).
    """
    spec = classes.get_class(priority_class)
    if spec is None:
        names = ", ".join(classes.all_classes())
        raise ValueError(f"Unknown class {priority_class!r}; choose one of: {names}.")
    with transaction.atomic():
        job = _locked_job(job_id)
        if job.status not in (Job.Status.PENDING, Job.Status.HELD):
            raise _state_error(
                job, "only a pending or held job can change its priority class"
            )
        if job.priority_class == spec.name:
            raise JobStateError(f"Job #{job.pk} is already in class {spec.name}.")
        if spec.interactive != bool(job.interactive):
            raise ValueError(
                f"Job #{job.pk} is {'an interactive' if job.interactive else 'a batch'}"
                f" job; the {spec.name} class is for"
                f" {'interactive' if spec.interactive else 'batch'} jobs only."
            )
        if job.time_limit_s > spec.max_time_limit:
            raise ValueError(
                f"Job #{job.pk}'s time limit ({job.time_limit_s // 3600} h) is above"
                f" the {spec.name} class's maximum ({spec.max_time_limit // 3600} h)."
            )
        old = job.priority_class
        job.priority_class = spec.name
        job.save(update_fields=["priority_class"])
        _event(
            job,
            f"priority class changed from {old} to {spec.name} by {by.get_username()}",
            source=JobEvent.Source.USER,
            actor=by,
        )
        announce(job, f"class {spec.name}")
        _pass_after_commit()
    return job


# The node's admin history, as the console's actions word it.
_MODE_HISTORY = {"drain": "drained", "maintenance": "put in maintenance"}


def set_node_mode(node_id: int, mode: NodeMode, *, by: User | None) -> bool:
    """Drain a node, put it in maintenance, or resume it (clears both); either
    of the first two keeps it from taking new jobs while running ones finish.
    Returns whether anything changed (under the node's row lock, so two admins
    acting at once change it once). Resuming asks for a pass.

    ``by``: who asks (the console, the API): they need ``drain_node``
    (``PermissionDenied`` else) and the change goes into the node's admin
    history under their name. None: gpulab itself."""
    if by is not None and not by.has_perm("scheduler.drain_node"):
        raise PermissionDenied(
            "Draining, maintenance and resuming a node need the drain_node permission."
        )
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        if not node.apply_mode(mode):  # the flags each verb leaves: models.nodes
            return False
        node.save(update_fields=["draining", "maintenance"])
        if by is not None:
            LogEntry.objects.log_actions(
                user_id=by.pk,
                queryset=[node],
                action_flag=CHANGE,
                change_message=_MODE_HISTORY.get(mode, "resumed"),
                single_object=True,
            )
        if mode == "resume":
            _pass_after_commit()
    return True


# What a waiting job asks for that an admin may change (the console's change
# form); its owner, group and class are changed otherwise or not at all.
REQUEST_FIELDS = (
    "name",
    "command",
    "workdir",
    "env",
    "gpus",
    "gpu_memory_mib",
    "gpu_model",
    "time_limit_s",
    "shareable",
    "slowdown_cap",
    "evictable",
    "workload",
    "requeue_on_node_loss",
    "kill_grace_s",
)
# Named, not quoted, in the job's history (long, or possibly secret).
_UNQUOTED = frozenset({"command", "workdir", "env"})


def validate_request_change(job: Job, changes: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``job``'s request that ``changes`` would change, cleaned:
    the whole request as it would become is checked by ``validate_job_request``,
    as the submit form and the API check a new one (a field-keyed
    ``ValidationError`` naming every problem). ``ValueError`` for a field not in
    ``REQUEST_FIELDS``."""
    unknown = set(changes) - set(REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"Not a request field: {', '.join(sorted(unknown))}.")
    fields = {f: getattr(job, f) for f in REQUEST_FIELDS} | dict(changes)
    req = JobRequest(priority_class=job.priority_class, **fields)
    cleaned = validate_job_request(req, job.owner.get_username())
    return {f: cleaned[f] for f in REQUEST_FIELDS if cleaned[f] != getattr(job, f)}


def change_job_request(job_id: int, changes: Mapping[str, Any], *, by: User) -> Job:
    """Change what a waiting job asks for (the admin console's change form).

    1. ``by`` needs ``scheduler.change_job`` (``PermissionDenied`` else).
    2. Lock the job; it must be PENDING (``JobStateError`` else: a job that left
       the queue keeps the request it was started with).
    3. Validate the request as it would become (``validate_request_change``);
       write the fields that change (a new workload label, GPU count or time
       limit predicts the run time again, as at submission), one event naming
       them and who; browsers told on commit, and a pass asked for.
    """
    if not by.has_perm("scheduler.change_job"):
        raise PermissionDenied("Changing a job's request needs change_job.")
    with transaction.atomic():
        job = _locked_job(job_id)
        if job.status != Job.Status.PENDING:
            raise _state_error(job, "only a waiting job's request can be changed")
        changed = validate_request_change(job, changes)
        if not changed:
            return job
        said = [
            f if f in _UNQUOTED else f"{f} {getattr(job, f)!r} -> {v!r}"
            for f, v in changed.items()
        ]
        for field, value in changed.items():
            setattr(job, field, value)
        update = list(changed)
        if {"workload", "gpus", "time_limit_s"} & changed.keys():
            job.predicted_runtime_s = predict_runtime(
                job.owner_id, job.workload, job.gpus, job.time_limit_s
            )
            update.append("predicted_runtime_s")
        job.save(update_fields=update)
        _event(
            job,
            f"request changed by {by.get_username()}: {', '.join(said)}",
            source=JobEvent.Source.USER,
            actor=by,
        )
        announce(job, "request changed")
        _pass_after_commit()
    return job
