"""Dependencies of a submission: the one parser of the text form
(``--after`` on the command line, the API's ``after``, the submit form's
"Run after"), its checks against the jobs the submitter may see, and the rows.

Grammar (Slurm's ``--dependency``, without ``?``): clauses joined by commas,
each ``[TYPE:]ID[:ID...]``, TYPE one of ``afterok``, ``afterany``, ``afternotok``
(a bare ID means ``afterany``, as in Slurm). An ID is a job id (``123``) or an
array (``a7``: every task of array 7, each one a dependency of its own, so
``afterok:a7`` waits for every task to complete).

The pass evaluates dependencies from their jobs' state every time
(``policy.dependency``): a dependency that has already ended, even the wrong
way, is accepted here and shown at the next pass (``dependency_never``), so a
submission racing its dependency's end cannot be decided on a stale read.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ValidationError

from scheduler.models import Job, JobDependency

if TYPE_CHECKING:
    from collections.abc import Sequence

    from django.contrib.auth.models import User

KINDS = tuple(JobDependency.Kind.values)
_ID_RE = re.compile(r"^(a?)([0-9]{1,18})$")

# (kind, "job" or "array", id)
Clause = tuple[str, str, int]


def parse_dependencies(text: str) -> list[Clause]:
    """``"afterok:12:13,a7"`` -> ``[("afterok", "job", 12), ("afterok", "job", 13),
    ("afterany", "array", 7)]``; a ``ValidationError`` on ``after`` naming the
    part that is wrong."""
    text = text.strip()
    if not text:
        return []
    clauses: list[Clause] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise ValidationError(
                {
                    "after": f"Empty clause in {text!r}; write e.g. afterok:12,afterany:13."
                }
            )
        items = [p.strip() for p in part.split(":")]
        kind = "afterany"
        if items[0].lower() in KINDS:
            kind = items.pop(0).lower()
        elif not _ID_RE.match(items[0].lower()):
            raise ValidationError(
                {
                    "after": f"Unknown dependency type {items[0]!r}; use"
                    f" {', '.join(KINDS)} (e.g. afterok:12)."
                }
            )
        if not items:
            raise ValidationError({"after": f"{part!r} names no job after {kind}."})
        for item in items:
            match = _ID_RE.match(item.lower())
            if match is None:
                raise ValidationError(
                    {
                        "after": f"{item!r} is not a job id (e.g. 12) or an array"
                        " id (e.g. a7)."
                    }
                )
            target = "array" if match.group(1) else "job"
            clauses.append((kind, target, int(match.group(2))))
    return clauses


def resolve_dependencies(owner: User, clauses: Sequence[Clause]) -> dict[int, str]:
    """The jobs the clauses name, as {job id: kind}: each must exist and be
    visible to ``owner`` (their own; staff: any), arrays expanded to their
    tasks. A job named twice with two kinds is refused; at most
    ``GPULAB_MAX_DEPENDENCIES`` jobs. Two queries."""
    if not clauses:
        return {}
    visible = Job.objects.visible_to(owner)
    job_ids = {i for _, t, i in clauses if t == "job"}
    array_ids = {i for _, t, i in clauses if t == "array"}
    found = set(visible.filter(pk__in=job_ids).values_list("pk", flat=True))
    tasks: dict[int, list[int]] = {}
    if array_ids:
        for array_id, pk in visible.filter(array_id__in=array_ids).values_list(
            "array_id", "pk"
        ):
            assert array_id is not None
            tasks.setdefault(array_id, []).append(pk)
    missing = [str(i) for i in sorted(job_ids - found)]
    missing += [f"a{i}" for i in sorted(array_ids - set(tasks))]
    if missing:
        raise ValidationError(
            {
                "after": f"No such job visible to you: {', '.join(missing)}."
                if len(missing) < 6
                else f"No such jobs visible to you: {', '.join(missing[:5])}"
                f" and {len(missing) - 5} more."
            }
        )
    out: dict[int, str] = {}
    for kind, target, ident in clauses:
        for job_id in tasks[ident] if target == "array" else [ident]:
            if out.get(job_id, kind) != kind:
                raise ValidationError(
                    {
                        "after": f"Job {job_id} is named with both {out[job_id]} and"
                        f" {kind}; give one type per job."
                    }
                )
            out[job_id] = kind
    limit = settings.GPULAB_MAX_DEPENDENCIES
    if len(out) > limit:
        raise ValidationError(
            {"after": f"{len(out)} jobs named; a job may wait for at most {limit}."}
        )
    return out


def dependency_rows(job: Job, deps: dict[int, str]) -> list[JobDependency]:
    return [
        JobDependency(job=job, depends_on_id=dep_id, kind=kind)
        for dep_id, kind in sorted(deps.items())
    ]


def format_dependencies(deps: Sequence[tuple[str, int]]) -> str:
    """The text form of stored dependencies, clauses grouped by type:
    ``afterok:12:13,afterany:14``."""
    by_kind: dict[str, list[int]] = {}
    for kind, job_id in deps:
        by_kind.setdefault(kind, []).append(job_id)
    return ",".join(
        f"{kind}:{':'.join(str(i) for i in sorted(ids))}"
        for kind, ids in by_kind.items()
    )
