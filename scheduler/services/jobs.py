"""User verbs on jobs: validation of a request (one copy of the rules), run-time
prediction, the group a job is charged to, submit and cancel.
"""

from __future__ import annotations

import secrets
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from agents import jobtext
from scheduler import classes
from scheduler.lifecycle import Cause
from scheduler.models import (
    Attempt,
    Gpu,
    Group,
    Job,
    JobDependency,
    JobEvent,
    Membership,
    Profile,
)
from scheduler.policy.predict import HISTORY, POOLS, History, Request, predict
from scheduler.services.common import (
    JobStateError,
    _event,
    _pass_after_commit,
    _send_kills_on_commit,
)
from scheduler.services.dependencies import (
    dependency_rows,
    format_dependencies,
    parse_dependencies,
    resolve_dependencies,
)
from scheduler.services.lifecycle import (
    announce,
    announce_many,
    transition,
    transition_many,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from datetime import datetime

    from django.contrib.auth.models import User


RESERVED_ENV = ("CUDA_VISIBLE_DEVICES",)
RESERVED_ENV_PREFIX = "GPULAB_"
# Simulator profile variables a job may set (agents/simulate.py reads them).
ALLOWED_GPULAB_ENV = ("GPULAB_SIM_UTIL", "GPULAB_SIM_MEM_MIB")


# ------------------------------------------------------------------ validation


def _bad_text(value: str, *, allow_newlines: bool, label: bool = False) -> str | None:
    """Why ``value`` is not acceptable text, or None.

    NUL can reach no process (execve ends a string there); the other control
    characters but tab, newline and CR (kept by the shell, and by multi-line
    commands and values) are refused because they would act on the terminal or
    page that shows the text back. A ``label`` (a name gpulab itself shows) also
    refuses bidirectional controls (``agents.jobtext``); text that runs verbatim
    keeps them and is shown with them marked.
    """
    if "\x00" in value:
        return "must not contain NUL characters"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid UTF-8 text"
    allowed = {"\n", "\t", "\r"} if allow_newlines else set()
    for ch in value:
        if ch not in allowed and unicodedata.category(ch) == "Cc":
            return (
                f"must not contain control characters (found {jobtext.codepoint(ch)})"
            )
    if label and (bidi := jobtext.first_bidi(value)) is not None:
        return (
            "must not contain bidirectional control characters, which reorder"
            f" how it reads (found {jobtext.codepoint(bidi)})"
        )
    return None


def workdir_allowed(path: str) -> bool:
    """Whether a normalised absolute ``path`` is one of
    ``GPULAB_WORKDIR_ALLOWED`` or lies under one of them."""
    for prefix in settings.GPULAB_WORKDIR_ALLOWED:
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return True
    return False


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
    # Co-location: a slowdown cap tighter than the class's (None: the class's),
    # and whether it may be requeued when its GPU partner suffers.
    slowdown_cap: float | None = None
    evictable: bool = True
    # Jobs it runs after, in the text form ``services.dependencies``
    # parses: "afterok:12:13,afterany:a7".
    after: str = ""
    # The job saves checkpoints: when preempted it is sent ``checkpoint_signal``
    # (a name of CHECKPOINT_SIGNALS; "": TERM), given ``checkpoint_grace_s``
    # (None: DEFAULT_CHECKPOINT_GRACE_S) to save and exit, and requeued.
    checkpointable: bool = False
    checkpoint_signal: str = ""
    checkpoint_grace_s: int | None = None
    # An interactive job ("jupyter", "shell"; "" batch): it runs in the
    # interactive class only, with the command ``interactive_request`` writes.
    interactive: str = ""


# What an interactive job's command is (the agent runs JupyterLab itself for
# "jupyter"; a "shell" job holds its GPUs for terminals until its limit or cancel).
INTERACTIVE_COMMANDS = {"jupyter": "jupyter lab", "shell": "exec sleep infinity"}
INTERACTIVE_NAMES = {"jupyter": "JupyterLab", "shell": "terminal"}


def interactive_request(
    kind: str,
    *,
    gpus: int = 1,
    gpu_memory_mib: int | None = None,
    time_limit_s: int | None = None,
    shareable: bool = False,
    group: str = "",
    workdir: str = "",
    name: str = "",
) -> JobRequest:
    """The request of an interactive job of ``kind`` ("jupyter" or "shell"):
    the product writes its name and command and puts it in the interactive
    class; the user chooses only its size, limit, sharing, group and workdir.
    ``submit_job`` stores it (an unknown kind is refused there)."""
    return JobRequest(
        name=name or INTERACTIVE_NAMES.get(kind, kind),
        command=INTERACTIVE_COMMANDS.get(kind, "true"),
        workdir=workdir,
        gpus=gpus,
        gpu_memory_mib=gpu_memory_mib,
        time_limit_s=time_limit_s,
        priority_class=_interactive_class_name(),
        shareable=shareable,
        group=group,
        interactive=kind,
    )


def _interactive_class_name() -> str:
    return classes.interactive_class().name


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
# Signals a checkpointable job may ask to be stopped with (by name, without SIG):
# the ones a training script can trap and that kill nothing else by default.
CHECKPOINT_SIGNALS = ("TERM", "INT", "USR1", "USR2")
DEFAULT_CHECKPOINT_GRACE_S = 60


def checkpoint_signal_name(value: str) -> str | None:
    """The canonical name ("USR1") of a checkpoint signal given as "usr1",
    "SIGUSR1" or "USR1"; "" is TERM; None if it is not one of CHECKPOINT_SIGNALS."""
    name = value.strip().upper() or "TERM"
    name = name.removeprefix("SIG")
    return name if name in CHECKPOINT_SIGNALS else None


def validate_job_request(req: JobRequest, username: str = "") -> dict[str, Any]:
    """Check a request; return the cleaned fields or raise a field-keyed
    ``ValidationError`` naming every problem."""
    errors: dict[str, str] = {}
    name = req.name.strip()
    if not name:
        errors["name"] = "Give the job a name."
    elif len(name) > 128:
        errors["name"] = "The name is longer than 128 characters."
    elif problem := _bad_text(name, allow_newlines=False, label=True):
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

    given = req.workdir.strip()
    workdir = given or settings.GPULAB_DEFAULT_WORKDIR.replace("{user}", username)
    if problem := _bad_text(workdir, allow_newlines=False):
        errors["workdir"] = f"The working directory {problem}."
    elif not workdir.startswith("/"):
        errors["workdir"] = "The working directory must be an absolute path."
    elif len(workdir) > 1024:
        errors["workdir"] = "The working directory path is too long."
    else:
        workdir = jobtext.normal_workdir(workdir)
        if not workdir_allowed(workdir):
            allowed = ", ".join(settings.GPULAB_WORKDIR_ALLOWED)
            source = "" if given else " (GPULAB_DEFAULT_WORKDIR)"
            errors["workdir"] = (
                f"The working directory {workdir}{source} is outside the"
                f" directories jobs may run in (GPULAB_WORKDIR_ALLOWED): {allowed}."
            )

    env = dict(req.env or {})
    for key, value in env.items():
        if not jobtext.is_env_name(key):
            errors["env"] = (
                f"{key!r} is not a valid environment variable name: use letters,"
                " digits and _, not starting with a digit (the shell drops others)."
            )
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
    if req.interactive not in INTERACTIVE_COMMANDS and req.interactive:
        errors["interactive"] = (
            f"Unknown interactive kind {req.interactive[:20]!r};"
            f" choose one of: {', '.join(INTERACTIVE_COMMANDS)}."
        )
    if pclass is None:
        names = ", ".join(n for n, _ in classes.class_choices())
        errors["priority_class"] = (
            f"Unknown class {req.priority_class!r}; choose one of: {names}."
        )
    elif pclass.interactive and not req.interactive:
        names = ", ".join(n for n, _ in classes.class_choices())
        errors["priority_class"] = (
            f"The {pclass.name} class is for interactive jobs (JupyterLab, a"
            f" terminal); a batch job chooses one of: {names}."
        )
    elif req.interactive and not pclass.interactive:
        errors["priority_class"] = (
            f"An interactive job runs in the interactive class, not {pclass.name}."
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
    if problem := _bad_text(workload, allow_newlines=False, label=True):
        errors["workload"] = f"The workload label {problem}."
    elif len(workload) > 128:
        errors["workload"] = "The workload label is longer than 128 characters."

    cap = req.slowdown_cap
    if cap is not None:
        class_cap = pclass.slowdown_cap if pclass is not None else None
        if not req.shareable:
            errors["slowdown_cap"] = (
                "A slowdown cap only applies to a job that may share a GPU."
            )
        elif not (cap >= 1.0 and cap < float("inf")):
            errors["slowdown_cap"] = (
                "The slowdown cap is a factor of 1 or more (1.2: at most 20 % slower)."
            )
        elif class_cap is not None and cap > class_cap:
            errors["slowdown_cap"] = (
                f"The {pclass.name if pclass else ''} class already caps slowdowns at"
                f" {class_cap:g}x; ask for a tighter cap or leave it empty."
            )

    grace = settings.GPULAB_KILL_GRACE if req.kill_grace_s is None else req.kill_grace_s
    if not 0 <= grace <= MAX_KILL_GRACE_S:
        errors["kill_grace_s"] = (
            f"The grace period must be between 0 and {MAX_KILL_GRACE_S} seconds."
        )

    signal_name = checkpoint_signal_name(req.checkpoint_signal)
    checkpoint_grace = (
        DEFAULT_CHECKPOINT_GRACE_S
        if req.checkpoint_grace_s is None
        else req.checkpoint_grace_s
    )
    if signal_name is None:
        errors["checkpoint_signal"] = (
            f"Unknown checkpoint signal {req.checkpoint_signal.strip()[:20]!r};"
            f" choose one of: {', '.join(CHECKPOINT_SIGNALS)}."
        )
    elif not req.checkpointable and signal_name != "TERM":
        errors["checkpoint_signal"] = (
            "A checkpoint signal only applies to a checkpointable job."
        )
    if not 0 <= checkpoint_grace <= MAX_KILL_GRACE_S:
        errors["checkpoint_grace_s"] = (
            f"The checkpoint grace must be between 0 and {MAX_KILL_GRACE_S} seconds."
        )
    elif not req.checkpointable and req.checkpoint_grace_s is not None:
        errors["checkpoint_grace_s"] = (
            "A checkpoint grace only applies to a checkpointable job."
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
        "slowdown_cap": cap,
        "evictable": req.evictable,
        "checkpointable": req.checkpointable,
        "checkpoint_signal": signal_name,
        "checkpoint_grace_s": checkpoint_grace,
        "interactive": req.interactive,
    }


PREDICTION_HISTORY = HISTORY


def predict_runtime(
    user_id: int, workload: str, gpus: int, time_limit_s: float
) -> int | None:
    """A waiting job's run time predicted from completed jobs by the shared rule
    that ``GPULAB_PREDICTION`` names (``scheduler.policy.predict``); None without
    history (the job then plans with its limit). One query.

    ``longest``: the longest of the user's last ``PREDICTION_HISTORY`` runs with
    the same workload label, else with any label. ``pools``: the median of the
    most specific pool (``predict.POOLS``) that holds enough runs; the query reads
    the last ``HISTORY`` runs of each of the job's pools."""
    if settings.GPULAB_POLICY.get("prediction", "longest") == "pools":
        return _predict_pools(user_id, workload, gpus, time_limit_s)
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
    got = predict(same[:HISTORY] or [d for _, d in runs[:HISTORY]])
    return None if got is None else max(1, round(got))


# The job's fields that key a pool (``predict.Pool.fields``).
_POOL_FIELDS = {
    "user": "job__owner_id",
    "workload": "job__workload",
    "gpus": "job__gpus",
    "limit": "job__time_limit_s",
}


def _predict_pools(
    user_id: int, workload: str, gpus: int, time_limit_s: float
) -> int | None:
    """``pools`` (``predict_runtime``): the last ``HISTORY`` runs of each of the
    job's pools in one query (a ``UNION ALL`` of one ``ORDER BY ended_at DESC
    LIMIT HISTORY`` per pool, so a popular pool such as a common time limit costs
    ``HISTORY`` rows, not all its runs), then the pure rule over them, fed oldest
    first: a run fed for one pool that also belongs to another is either among
    that pool's last runs or older than all of them, so each pool's history is
    exactly its last ``HISTORY`` runs."""
    values = {
        "user": user_id,
        "workload": workload,
        "gpus": gpus,
        "limit": time_limit_s,
    }
    per_pool = [
        Attempt.objects.filter(
            job__status=Job.Status.COMPLETED,
            started_at__isnull=False,
            ended_at__isnull=False,
            outcome=Attempt.Outcome.EXITED,
            **{_POOL_FIELDS[f]: values[f] for f in pool.fields},
        )
        .order_by("-ended_at", "-id")
        .values_list(
            "id",
            "job__owner_id",
            "job__workload",
            "job__gpus",
            "job__time_limit_s",
            "started_at",
            "ended_at",
        )[:HISTORY]
        for pool in POOLS
    ]
    runs = {
        attempt: (ended, Request(str(owner), label, n, float(limit)), started)
        for attempt, owner, label, n, limit, started, ended in per_pool[0].union(
            *per_pool[1:], all=True
        )
        if started and ended
    }
    history = History(HISTORY)
    for attempt in sorted(runs, key=lambda a: (runs[a][0], a)):
        ended, req, started = runs[attempt]
        history.add(req, (ended - started).total_seconds())
    got, _ = history.predict(Request(str(user_id), workload, gpus, float(time_limit_s)))
    return None if got is None else max(1, round(got))


def groups_of(user: User) -> list[Group]:
    return list(Group.objects.filter(membership__user=user).order_by("name"))


def _charge_group(user: User, name: str) -> Group:
    """The group a job is charged to: the named one (if the user is a member), else
    the user's primary group (``Profile.primary_group``, if still a member), else
    their first group; a user in no group joins the default group."""
    mine = groups_of(user)
    if name:
        for group in mine:
            if group.name == name:
                return group
        raise ValidationError({"group": f"You are not a member of group {name!r}."})
    primary = Profile.objects.filter(user=user).values_list("primary_group", flat=True)
    for group in mine:
        if group.pk in primary:
            return group
    if mine:
        return mine[0]
    group, _ = Group.objects.get_or_create(name=settings.GPULAB_DEFAULT_GROUP)
    Membership.objects.get_or_create(user=user, group=group)
    return group


# ------------------------------------------------------------------ user verbs


def validated_submission(
    owner: User, req: JobRequest
) -> tuple[dict[str, Any], dict[int, str]]:
    """The cleaned fields of a request and its dependencies ({job id: kind}), or a
    field-keyed ``ValidationError`` naming every problem at once."""
    errors: dict[str, list[str]] = {}
    fields: dict[str, Any] = {}
    deps: dict[int, str] = {}
    try:
        fields = validate_job_request(req, owner.get_username())
    except ValidationError as exc:
        errors.update(exc.message_dict)
    try:
        deps = resolve_dependencies(owner, parse_dependencies(req.after))
    except ValidationError as exc:
        errors.update(exc.message_dict)
    if errors:
        raise ValidationError(errors)
    return fields, deps


def _check_interactive_cap(owner: User) -> None:
    """Refuse a user's interactive job beyond ``GPULAB_INTERACTIVE_MAX_PER_USER``
    unfinished ones, naming those they have. The caller holds the user's row
    lock, so two submissions at once cannot both pass."""
    cap = settings.GPULAB_INTERACTIVE_MAX_PER_USER
    mine = list(
        Job.objects.filter(owner=owner)
        .exclude(interactive="")
        .exclude(status__in=Job.TERMINAL)
        .order_by("id")
        .values_list("id", flat=True)
    )
    if len(mine) >= cap:
        ids = ", ".join(f"#{i}" for i in mine)
        have = f"you already have {ids}" if mine else "none are allowed"
        raise ValidationError(
            {
                "interactive": (
                    f"At most {cap} interactive job(s) at a time per user"
                    f" (GPULAB_INTERACTIVE_MAX_PER_USER); {have}: end it first."
                )
            }
        )


def submit_job(owner: User, req: JobRequest) -> Job:
    """Validate and store a new PENDING job (with its dependencies, if any), then
    ask for a scheduling pass. An interactive job (``interactive_request``) is
    also held to the per-user cap and given its server's secret token."""
    fields, deps = validated_submission(owner, req)
    predicted = predict_runtime(
        owner.pk, fields["workload"], fields["gpus"], fields["time_limit_s"]
    )
    with transaction.atomic():
        if req.interactive:
            get_user_model().objects.select_for_update().filter(pk=owner.pk).first()
            _check_interactive_cap(owner)
            fields["interactive_token"] = secrets.token_urlsafe(32)
        group = _charge_group(owner, req.group)
        job = Job.objects.create(
            owner=owner,
            group=group,
            predicted_runtime_s=predicted,
            pending_message="waiting for the scheduler",
            **fields,
        )
        message = f"submitted by {owner.get_username()}"
        if deps:
            JobDependency.objects.bulk_create(dependency_rows(job, deps))
            message += "; runs after " + format_dependencies(
                [(k, i) for i, k in deps.items()]
            )
        _event(
            job,
            message,
            source=JobEvent.Source.USER,
            actor=owner,
            to_status=job.status,
        )
        announce(job, "submitted")
        _pass_after_commit()
    return job


def cancel_job(job_id: int, *, by: User | None, reason: str = "") -> Job:
    """Cancel a job.

    1. Lock the job row.
    2. PENDING / HELD: it becomes CANCELLED at once, and a pass is asked for
       after commit (the jobs behind it may start now, and its dependents end).
    3. STARTING / RUNNING: record the request and, after commit, send ``job.kill``
       to its node; the job becomes CANCELLED when the agent reports the exit.
    ``by`` None: gpulab cancels it itself (an idle job), ``reason`` says why;
    otherwise ``by`` must be allowed to (``Job.may_cancel``: its owner or an
    admin with ``cancel_any_job``), else ``PermissionDenied`` and nothing changes.
    """
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if by is not None and not job.may_cancel(by):
            raise PermissionDenied(f"You may not cancel job #{job.pk}.")
        if job.is_terminal:
            raise JobStateError(f"Job #{job.pk} has already ended ({job.status}).")
        if job.cancel_requested_at is not None:
            raise JobStateError(f"Job #{job.pk} is already being cancelled.")
        _cancel_locked(job, by=by, reason=reason)
    return job


def _canceller(by: User | None, reason: str) -> tuple[str, str]:
    """Who a cancel's events name ("alice (reason)", "gpulab") and their source."""
    who = by.get_username() if by is not None else "gpulab"
    who += f" ({reason})" if reason else ""
    source = JobEvent.Source.USER if by is not None else JobEvent.Source.SYSTEM
    return who, source


def _cancel_locked(job: Job, *, by: User | None, reason: str = "") -> None:
    """Steps 2-3 of ``cancel_job`` on a job the caller has locked and checked
    (active, no cancel asked yet); ``_cancel_many_locked`` is its batch form."""
    now = timezone.now()
    who, source = _canceller(by, reason)
    if job.status in (Job.Status.PENDING, Job.Status.HELD):
        transition(
            job,
            Job.Status.CANCELLED,
            Cause.CANCEL,
            f"cancelled by {who}",
            source=source,
            actor=by,
            at=now,
            notice="cancelled",
            cancel_requested_at=now,
            pending_reason="",
            pending_message="",
        )
        return
    _stop_on_node([job], who=who, source=source, by=by, now=now)
    announce(job, "cancelling")


def _stop_on_node(
    jobs: Sequence[Job],
    *,
    who: str,
    source: str,
    by: User | None,
    now: datetime,
) -> None:
    """The cancel request of running jobs: ``cancel_requested_at`` in one
    UPDATE, their events in one insert, each live attempt's ``job.kill``
    (SIGTERM and the job's grace, all sent in one go after commit). Each ends
    CANCELLED when its exit is reported."""
    ids = [j.pk for j in jobs]
    Job.objects.filter(pk__in=ids).update(cancel_requested_at=now)
    message = f"cancel requested by {who}; stopping the process"[:500]
    JobEvent.objects.bulk_create(
        [
            JobEvent(job=job, message=message, source=source, actor=by, at=now)
            for job in jobs
        ]
    )
    grace = {job.pk: job.kill_grace_s for job in jobs}
    for job in jobs:
        job.cancel_requested_at = now
    live_attempts = Attempt.objects.filter(job_id__in=ids, ended_at__isnull=True)
    _send_kills_on_commit([(a, grace[a.job_id]) for a in live_attempts], "cancelled")


def _cancel_many_locked(
    jobs: Sequence[Job], *, by: User | None, what: str, reason: str = ""
) -> None:
    """``_cancel_locked`` of many jobs the caller has locked (in id order) and
    checked (active, no cancel asked yet), in a fixed number of queries however
    many there are (``services.cancel_array``); ``what`` names them for their
    owner ("array 12 (sweep)").

    The waiting ones end CANCELLED in one ``transition_many`` (one UPDATE, one
    insert of their events, one notice to the owner, one pass); the running
    ones get their cancel request in one UPDATE, their events in one insert,
    each live attempt its ``job.kill`` (all sent in one go after commit), and
    end CANCELLED as each exit is reported (their owner is told then, as for
    one job)."""
    now = timezone.now()
    who, source = _canceller(by, reason)
    waiting = [j for j in jobs if j.status in (Job.Status.PENDING, Job.Status.HELD)]
    on_node = [j for j in jobs if j.status in Job.ON_NODE]
    summary = f"{what}: {len(waiting)} waiting tasks cancelled by {who}"
    if on_node:
        summary += f"; {len(on_node)} running tasks are being stopped"
    transition_many(
        waiting,
        Job.Status.CANCELLED,
        Cause.CANCEL,
        f"cancelled by {who}",
        source=source,
        summary=summary,
        actor=by,
        at=now,
        notice="cancelled",
        cancel_requested_at=now,
        pending_reason="",
        pending_message="",
    )
    if not on_node:
        return
    _stop_on_node(on_node, who=who, source=source, by=by, now=now)
    announce_many(on_node, "cancelling", summary=summary)
