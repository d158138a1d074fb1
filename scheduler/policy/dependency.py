"""Dependencies in the pass: the gate's check (``stages.gate``) for a job that may start
only after other jobs end (Slurm's ``--dependency``).

- ``afterok``: the job it names completed (exit 0);
- ``afternotok``: it ended any other way (failed, cancelled, timed out);
- ``afterany``: it ended, however.

A job waits ``DEPENDENCY`` while any job it names has not ended. When one has
ended the wrong way (``afterok`` on a failed job, ``afternotok`` on a completed
one), the dependency can never be met: the job stays PENDING with the reason
``DEPENDENCY_NEVER`` naming the job and how it ended, as Slurm's
``DependencyNeverSatisfied`` (its default, without ``kill_invalid_depend``): the
owner sees why and cancels it (or an admin does); nothing is cancelled behind
their back, and a job waiting on it waits (``DEPENDENCY``) until then. Such a
job is never the top blocked job: it reserves and preempts nothing.

States are ``Job.Status`` values as plain strings; the loader gives each pending
job its dependencies with their state now, in one query for the whole pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.policy.state import Reason

if TYPE_CHECKING:
    from scheduler.policy.state import Dependency, PendingJob

COMPLETED = "completed"
NOT_OK = frozenset({"failed", "cancelled", "timeout"})
ENDED = NOT_OK | {COMPLETED}
KINDS = ("afterok", "afterany", "afternotok")


_VERBS = {
    "completed": "completed",
    "failed": "failed",
    "cancelled": "was cancelled",
    "timeout": "timed out",
}


def _ended(dep: Dependency) -> str:
    """ "job 5 failed (exit 1)" and the like."""
    exit_code = f" (exit {dep.exit_code})" if dep.exit_code is not None else ""
    return f"job {dep.job_id} {_VERBS.get(dep.status, dep.status)}{exit_code}"


def met(dep: Dependency) -> bool | None:
    """True: met; False: can never be met; None: not yet (the job has not ended)."""
    if dep.status not in ENDED:
        return None
    if dep.kind == "afterany":
        return True
    if dep.kind == "afterok":
        return dep.status == COMPLETED
    if dep.kind == "afternotok":
        return dep.status in NOT_OK
    return False  # an unknown kind is never met (the loader passes known ones)


def refusal(job: PendingJob) -> tuple[Reason, str] | None:
    """Why ``job`` may not start yet because of its dependencies, or None."""
    if not job.dependencies:
        return None
    waiting: list[Dependency] = []
    for dep in job.dependencies:
        got = met(dep)
        if got is False:
            return (
                Reason.DEPENDENCY_NEVER,
                f"can never start: {_ended(dep)} and this job runs after it"
                f" with {dep.kind}; cancel it",
            )
        if got is None:
            waiting.append(dep)
    if not waiting:
        return None
    first = waiting[0]
    more = f" and {len(waiting) - 1} more" if len(waiting) > 1 else ""
    return (
        Reason.DEPENDENCY,
        f"waiting for job {first.job_id} ({first.status}){more} to end ({first.kind})",
    )
