"""The only writer of a job's state and of an attempt's end.

``transition`` moves one job: it locks the job's row, checks the change against
``scheduler.lifecycle.TRANSITIONS`` (a change the table forbids raises
``ForbiddenTransition`` and changes nothing), writes the state with the fields
that go with it, one ``JobEvent``, and registers what follows the commit: the
browsers' live update, the owner's notification (``hooks.notifier()``) and, when
the change frees GPUs or changes the queue, a scheduling pass. ``start_many`` is
the same for a pass's starts in a fixed number of queries, ``transition_many``
for many waiting jobs moved at once (an array's cancel). ``end_attempt`` /
``correct_attempt_end`` are the only code that sets an attempt's end (``ended_at``,
``outcome``, ``exit_code``).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from scheduler import events, hooks, live
from scheduler.lifecycle import PASSING, Cause, ForbiddenTransition, check
from scheduler.models import Allocation, Attempt, Job, JobEvent
from scheduler.services import interference
from scheduler.services.common import _event, _pass_after_commit

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import datetime

    from django.contrib.auth.models import User

# What a job's end reason holds (``Job.end_reason``).
END_REASON_MAX = 200


def transition(
    job: Job,
    to: Job.Status,
    cause: Cause,
    message: str,
    *,
    source: str,
    actor: User | None = None,
    at: datetime | None = None,
    notice: str | None = None,
    exit_code: int | None = None,
    **changes: Any,
) -> JobEvent:
    """Move ``job`` to ``to`` for ``cause``; return the event written.

    1. Lock the job's row and read its stored state (the caller's copy may be
       older); ``ForbiddenTransition`` if the table does not allow the change for
       ``cause``: nothing is written.
    2. Save the new state with ``changes`` (other fields of the job that change
       with it); entering an end state also sets ``finished_at`` (``at``, default
       now), ``end_reason`` (``message``) and ``exit_code``.
    3. One ``JobEvent`` (``message``, ``source``, ``actor``, from -> to, at ``at``).
    4. Unless ``to`` is a state the job only passes through: the owner's
       notifier hears of it now (its outbox rows are part of this transaction),
       browsers after commit (``notice``, default ``message``; the owner is told
       of a start too), and a pass is asked for if the rule says the change
       frees GPUs or changes the queue.
    Must run inside a transaction (the row lock needs one).
    """
    if "status" in changes:
        raise TypeError("transition() sets the status itself: pass it as `to`")
    at = at or timezone.now()
    stored = Job.objects.select_for_update().values_list("status", flat=True)
    source_state = stored.get(pk=job.pk)
    rule = check(job.pk, source_state, to, cause)
    job.status = to
    fields = ["status"]
    if to in Job.TERMINAL:
        changes.update(
            finished_at=at, end_reason=message[:END_REASON_MAX], exit_code=exit_code
        )
    for name, value in changes.items():
        setattr(job, name, value)
        fields.append(name)
    job.save(update_fields=fields)
    event = _event(
        job,
        message,
        source=source,
        actor=actor,
        from_status=source_state,
        to_status=to,
        at=at,
    )
    if to not in PASSING:
        announce(job, notice or message)
        if to == Job.Status.RUNNING:
            hooks.notifier().job_started(job, notice or message)
        if rule.wakes_pass:
            _pass_after_commit()
    return event


def announce(job: Job, message: str) -> None:
    """Tell the job's owner (an end or a failure: their outbox, in this
    transaction) and, after commit, the browsers (the job's page, and the queue
    page at the next live round) of its state."""
    hooks.notifier().job_changed(job, message)
    transaction.on_commit(
        partial(events.broadcast_job_status, job.pk, job.status, message)
    )
    transaction.on_commit(live.mark_queue_changed)


def announce_many(jobs: Sequence[Job], notice: str, *, summary: str) -> None:
    """``announce`` of many jobs at once: their owners' notifier once
    (``jobs_changed`` with ``summary``: an end is one notice per owner), and
    after commit one send of ``job.status`` (``notice``) to the watched pages
    of these jobs (``live.broadcast_job_statuses``) and one queue mark."""
    if not jobs:
        return
    hooks.notifier().jobs_changed(jobs, summary)
    statuses = [(job.pk, str(job.status), notice) for job in jobs]
    transaction.on_commit(partial(live.broadcast_job_statuses, statuses))
    transaction.on_commit(live.mark_queue_changed)


def transition_many(
    jobs: Sequence[Job],
    to: Job.Status,
    cause: Cause,
    message: str,
    *,
    source: str,
    summary: str,
    actor: User | None = None,
    at: datetime | None = None,
    notice: str | None = None,
    **changes: Any,
) -> list[JobEvent]:
    """``transition`` of many jobs to one state for one cause, in a fixed number
    of queries whatever their number (an array's waiting tasks cancelled).

    The jobs are locked by the caller (``SELECT ... FOR UPDATE``, in id order)
    and their ``status`` read under that lock.

    1. One table check per state they come from (``ForbiddenTransition``,
       nothing written, if one is not allowed).
    2. One UPDATE of the state and ``changes`` (the same for every job; an end
       state also sets ``finished_at``, ``end_reason`` and ``exit_code`` as
       ``transition`` does), guarded by each job's stored state: a row that is
       no longer in it raises ``ForbiddenTransition`` (the caller's transaction
       rolls the batch back) instead of being overwritten.
    3. One insert of the events (``message``, from each job's state).
    4. The owners' notifier once for the batch (``jobs_changed`` with
       ``summary``: one notice per owner), the browsers after commit in one
       send to the watched job pages (``notice``, default ``message``) and one
       queue mark, and one pass if the rule says so.
    """
    if not jobs:
        return []
    if "status" in changes:
        raise TypeError("transition_many() sets the status itself: pass it as `to`")
    if to in PASSING or to == Job.Status.RUNNING:
        raise ValueError(f"transition_many() does not move jobs to {to}")
    at = at or timezone.now()
    by_state: dict[str, list[int]] = {}
    for job in jobs:
        by_state.setdefault(job.status, []).append(job.pk)
    rules = [check(ids[0], state, to, cause) for state, ids in by_state.items()]
    if to in Job.TERMINAL:
        changes.update(
            finished_at=at, end_reason=message[:END_REASON_MAX], exit_code=None
        )
    guard = Q()
    for state, ids in by_state.items():
        guard |= Q(pk__in=ids, status=state)
    updated = Job.objects.filter(guard).update(status=to, **changes)
    if updated != len(jobs):
        stored = dict(
            Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("pk", "status")
        )
        moved = next((j for j in jobs if stored.get(j.pk) != to), jobs[0])
        raise ForbiddenTransition(moved.pk, stored.get(moved.pk, "gone"), to, cause)
    rows = []
    for job in jobs:
        rows.append(
            JobEvent(
                job=job,
                message=message[:500],
                source=source,
                actor=actor,
                from_status=job.status,
                to_status=to,
                at=at,
            )
        )
        job.status = to
        for name, value in changes.items():
            setattr(job, name, value)
    made = JobEvent.objects.bulk_create(rows)
    announce_many(jobs, notice or message, summary=summary)
    if any(rule.wakes_pass for rule in rules):
        _pass_after_commit()
    return made


def start_many(
    started: Sequence[tuple[Job, str, str]], *, at: datetime
) -> list[JobEvent]:
    """PENDING -> STARTING for a pass's starts: ``(job, event message, notice)``
    each, the jobs already locked by the caller (in id order, before their GPUs)
    and read PENDING under that lock.

    One table check per state the jobs come from (PENDING), one UPDATE (state, one more
    attempt, the waiting reason cleared; it re-checks PENDING and raises
    ``ForbiddenTransition`` if a row was not, so the caller's savepoint rolls the
    batch back), one insert of the events; browsers told after commit.
    """
    if not started:
        return []
    for source in {job.status for job, _, _ in started}:
        job_id = next(job.pk for job, _, _ in started if job.status == source)
        check(job_id, source, Job.Status.STARTING, Cause.START)
    ids = [job.pk for job, _, _ in started]
    updated = Job.objects.filter(pk__in=ids, status=Job.Status.PENDING).update(
        status=Job.Status.STARTING,
        attempts=F("attempts") + 1,
        pending_reason="",
        pending_message="",
    )
    if updated != len(ids):
        stored = dict(Job.objects.filter(pk__in=ids).values_list("pk", "status"))
        # the rows updated read STARTING now: the others were not PENDING
        job_id = next(
            (pk for pk in ids if stored.get(pk) != Job.Status.STARTING), ids[0]
        )
        raise ForbiddenTransition(
            job_id, stored.get(job_id, "gone"), Job.Status.STARTING, Cause.START
        )
    rows = []
    for job, message, _ in started:
        job.status = Job.Status.STARTING
        job.attempts += 1
        job.pending_reason = job.pending_message = ""
        rows.append(
            JobEvent(
                job=job,
                message=message[:500],
                source=JobEvent.Source.SCHEDULER,
                from_status=Job.Status.PENDING,
                to_status=Job.Status.STARTING,
                at=at,
            )
        )
    events_made = JobEvent.objects.bulk_create(rows)
    for job, _, notice in started:
        announce(job, notice)
    return events_made


def end_attempt(
    attempt: Attempt, ended: datetime, outcome: str, exit_code: int | None
) -> None:
    """End a live attempt (locked): its end, outcome and exit code; its GPU slots
    released at ``ended``; the sharing episodes it was in closed; its GPU time
    charged (``hooks.accounting().attempt_ended``: agent-reported start to
    ``ended``)."""
    attempt.ended_at = ended
    attempt.outcome = outcome
    attempt.exit_code = exit_code
    attempt.save(update_fields=["ended_at", "outcome", "exit_code"])
    allocations = list(attempt.allocations.filter(released_at__isnull=True))
    Allocation.objects.filter(pk__in=[a.pk for a in allocations]).update(
        released_at=ended
    )
    interference.record_episode_ends(attempt, ended)
    hooks.accounting().attempt_ended(attempt)


def correct_attempt_end(
    attempt: Attempt, ended: datetime, exit_code: int | None
) -> None:
    """An ended attempt's end moved by a late report of its agent
    (``late_reports.late_exit``, which set its ``rank_exits``): saved with its
    end, and the exit code if it had none. The caller moves the slots' release
    and the charges."""
    if attempt.exit_code is None:
        attempt.exit_code = exit_code
    attempt.ended_at = ended
    attempt.save(update_fields=["rank_exits", "ended_at", "exit_code"])


def unlaunched_attempts(job: Job) -> int:
    """The job's attempts that ended without running (``Attempt.UNLAUNCHED``):
    what ``lifecycle.relaunch`` weighs against ``GPULAB_RELAUNCH_MAX``."""
    return Attempt.objects.filter(job=job, outcome__in=Attempt.UNLAUNCHED).count()
