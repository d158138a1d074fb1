"""Job arrays: one submission, many tasks (Slurm's ``--array``).

Each task is a ``Job`` of its own (its own state, attempts, logs and charges)
with its ``array_index``, which the agent puts in its environment as
``GPULAB_ARRAY_INDEX`` (``starts.launch_frame``). The run-at-once limit
(``%N``) is enforced by the pure policy (``policy.arrays``); cancelling an
array cancels every task still active under their row locks, in a fixed number
of queries (``jobs._cancel_many_locked``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from scheduler.models import Job, JobArray, JobDependency, JobEvent, may_cancel
from scheduler.services.common import _pass_after_commit
from scheduler.services.dependencies import (
    dependency_rows,
    format_dependencies,
)
from scheduler.services.jobs import (
    JobRequest,
    _cancel_many_locked,
    _charge_group,
    predict_runtime,
    validated_submission,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

# The largest index a task may have (Slurm's MaxArraySize - 1 is 1000 by default;
# ours is wider so that sweeps can encode parameters in the index).
MAX_ARRAY_INDEX = 1_000_000
_RANGE_RE = re.compile(r"([0-9]{1,7})(?:-([0-9]{1,7})(?::([0-9]{1,7}))?)?")
_LIMIT_RE = re.compile(r"[0-9]{1,7}")


def parse_array_spec(text: str) -> tuple[list[int], int | None, str]:
    """``"0-99%8"`` -> (indexes 0..99, run at most 8 at once, ``"0-99%8"``).

    Grammar (Slurm's ``--array``): comma-separated ``N``, ``A-B`` or ``A-B:STEP``,
    optionally ``%LIMIT`` at the end, in ASCII digits. At most
    ``GPULAB_MAX_ARRAY_SIZE`` tasks, indexes 0 to ``MAX_ARRAY_INDEX``, each
    once; a limit of 1 to ``GPULAB_MAX_ARRAY_SIZE`` (more could never bind). A
    ``ValidationError`` on ``array`` names what is wrong."""

    def bad(message: str) -> ValidationError:
        return ValidationError({"array": message})

    text = text.strip()
    if not text:
        raise bad("Give the array's indexes, e.g. 0-99 or 0-99%8 or 1,3,5-7.")
    body, sep, limit_text = text.partition("%")
    maximum = settings.GPULAB_MAX_ARRAY_SIZE
    limit: int | None = None
    if sep:
        # ASCII digits only: str.isdigit() also says yes to "²", which int()
        # refuses, and int() reads other scripts' digits ("٣").
        digits = _LIMIT_RE.fullmatch(limit_text)
        limit = int(limit_text) if digits is not None else 0
        if not 1 <= limit <= maximum:
            raise bad(
                f"{'%' + limit_text[:20]!r}: the limit after % is a whole number"
                f" from 1 to {maximum}."
            )
    seen: set[int] = set()
    indexes: list[int] = []
    for raw in body.split(","):
        part = raw.strip()
        match = _RANGE_RE.fullmatch(part)
        if match is None:
            raise bad(
                f"{part[:40]!r} is not an index, a range A-B or a range A-B:STEP."
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        step = int(match.group(3)) if match.group(3) is not None else 1
        if last < first:
            raise bad(f"{part!r}: the range ends before it starts.")
        if step < 1:
            raise bad(f"{part!r}: the step is at least 1.")
        if last > MAX_ARRAY_INDEX:
            raise bad(f"{part!r}: indexes go up to {MAX_ARRAY_INDEX}.")
        if (last - first) // step + 1 + len(indexes) > maximum:
            raise bad(f"An array has at most {maximum} tasks.")
        for i in range(first, last + 1, step):
            if i in seen:
                raise bad(f"Index {i} is given twice.")
            seen.add(i)
            indexes.append(i)
    normal = ",".join(p.strip() for p in body.split(","))
    return indexes, limit, normal + (f"%{limit}" if limit is not None else "")


def submit_array(owner: User, req: JobRequest, spec: str) -> JobArray:
    """Validate the request once (the same rules as one job) and store an array
    of PENDING tasks, each with its index, dependencies and submit event, in one
    transaction; then ask for a scheduling pass.

    Every problem is reported at once (field-keyed, ``array`` for the spec)."""
    errors: dict[str, list[str]] = {}
    indexes: list[int] = []
    limit: int | None = None
    normal = ""
    try:
        indexes, limit, normal = parse_array_spec(spec)
    except ValidationError as exc:
        errors.update(exc.message_dict)
    try:
        fields, deps = validated_submission(owner, req)
    except ValidationError as exc:
        errors.update(exc.message_dict)
    if errors:
        raise ValidationError(errors)
    rows = len(indexes) * len(deps)
    if rows > settings.GPULAB_MAX_ARRAY_SIZE * 10:
        raise ValidationError(
            {
                "after": f"{len(indexes)} tasks each waiting for {len(deps)} jobs is"
                f" too many ({rows}); the limit is"
                f" {settings.GPULAB_MAX_ARRAY_SIZE * 10}."
            }
        )
    predicted = predict_runtime(
        owner.pk, fields["workload"], fields["gpus"], fields["time_limit_s"]
    )
    who = owner.get_username()
    after = format_dependencies([(k, i) for i, k in deps.items()])
    now = timezone.now()
    with transaction.atomic():
        group = _charge_group(owner, req.group)
        array = JobArray.objects.create(
            owner=owner,
            name=fields["name"],
            spec=normal,
            size=len(indexes),
            max_running=limit,
            created_at=now,
        )
        tasks = Job.objects.bulk_create(
            [
                Job(
                    owner=owner,
                    group=group,
                    predicted_runtime_s=predicted,
                    pending_message="waiting for the scheduler",
                    array=array,
                    array_index=index,
                    submitted_at=now,
                    **fields,
                )
                for index in indexes
            ]
        )
        if deps:
            JobDependency.objects.bulk_create(
                [row for task in tasks for row in dependency_rows(task, deps)]
            )
        message = f"submitted by {who} as task {{}} of array {array.pk} [{normal}]"
        if after:
            message += f"; runs after {after}"
        JobEvent.objects.bulk_create(
            [
                JobEvent(
                    job=task,
                    at=now,
                    source=JobEvent.Source.USER,
                    actor=owner,
                    to_status=Job.Status.PENDING,
                    message=message.format(task.array_index)[:500],
                )
                for task in tasks
            ]
        )
        # No per-task broadcast: nobody watches a job that did not exist.
        _pass_after_commit()
    return array


def cancel_array(array_id: int, *, by: User | None, reason: str = "") -> list[int]:
    """Cancel every task of an array that is still active and not already being
    cancelled; return their ids (in id order). A fixed number of queries
    whatever the array's size, plus nothing per task but its ``job.kill`` if it
    runs.

    1. Lock those tasks in id order (``SELECT ... FOR UPDATE``, one query): a
       task that a concurrent cancel (of the array, or of that one task) changed
       while we waited for its lock no longer matches and is skipped, so two
       cancels at once cancel each task once.
    2. All of them as ``cancel_job`` does one (``_cancel_many_locked``): the
       waiting ones end CANCELLED at once in one UPDATE, one event each (one
       insert), one notice to the owner for the array and one pass; the
       running ones get ``job.kill`` and end when their agents report it.

    ``by`` (None: gpulab itself) must be the array's owner or an admin with
    ``cancel_any_job`` (``Job.may_cancel``), else ``PermissionDenied``."""
    with transaction.atomic():
        array = JobArray.objects.only("owner_id", "name").get(pk=array_id)
        if by is not None and not may_cancel(by, owner_id=array.owner_id):
            raise PermissionDenied(f"You may not cancel array {array_id}.")
        tasks = list(
            Job.objects.select_for_update()
            .filter(
                array_id=array_id,
                status__in=Job.ACTIVE,
                cancel_requested_at__isnull=True,
            )
            .order_by("pk")
        )
        name = f" ({array.name})" if array.name else ""
        _cancel_many_locked(tasks, by=by, what=f"array {array_id}{name}", reason=reason)
    return [t.pk for t in tasks]
