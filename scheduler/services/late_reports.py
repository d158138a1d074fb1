"""Reports about an attempt the portal ended without the agent's word: its node was
declared lost (``liveness.mark_lost_nodes``: ended at the last heartbeat) or its
launch was given up (``liveness.resend_launches``). The job has moved on exactly
once (requeued or failed) and stays where it is; what changes is the record of
what ran: the agent's start and exit are the authoritative times (a job that
finished while its agent was disconnected is charged for what it ran), so the
attempt's times, its slots' release and its charges (``UsageRecord`` and
``DailyUsage`` through ``hooks.accounting().runs_changed``, so its GPU neighbours' shares
follow) are corrected, with a job event saying so.

Called by ``attempts.mark_started`` / ``finish_attempt`` with the attempt (and
job) row locked. Replays change nothing: a rank's start or exit already recorded
(``rank_starts`` / ``rank_exits``, for single-node attempts too) is ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler import hooks
from scheduler.models import Allocation, Attempt, Job, JobEvent, Node, UsageRecord
from scheduler.services.common import _event, _ts
from scheduler.services.lifecycle import correct_attempt_end

if TYPE_CHECKING:
    from datetime import datetime

    from agents import protocol

# Ended by the portal, without the agent's report: the ones a late report corrects.
PORTAL_ENDED = (Attempt.Outcome.NODE_LOST, Attempt.Outcome.LAUNCH_LOST)
# Exit reasons of a rank whose process never ran.
NOTHING_RAN = ("never_started", "launch_failed", "port_busy")


def corrects(attempt: Attempt) -> bool:
    return attempt.ended_at is not None and attempt.outcome in PORTAL_ENDED


def _charged_hours(attempt: Attempt) -> float:
    seconds = sum(
        UsageRecord.objects.filter(attempt=attempt).values_list(
            "gpu_seconds", flat=True
        )
    )
    return seconds / 3600


def _gpus(attempt: Attempt) -> list[int]:
    return sorted(
        set(Allocation.objects.filter(attempt=attempt).values_list("gpu_id", flat=True))
    )


def _fmt(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S %Z}"


def late_start(attempt: Attempt, node_id: int, data: protocol.JobStartedData) -> bool:
    """A start reported after the portal ended the attempt (the node came back and
    replayed it). Recorded, and the run charged up to the end the portal has, so
    a later exit has a start to charge from. False for a replay."""
    key = str(node_id)
    if key in attempt.rank_starts:
        return False
    started = _ts(data.started_at)
    attempt.rank_starts = {
        **attempt.rank_starts,
        key: {"started_at": data.started_at, "pid": data.pid},
    }
    fields = ["rank_starts"]
    if attempt.started_at is None or started < attempt.started_at:
        attempt.started_at = started
        attempt.pid = data.pid
        fields += ["started_at", "pid"]
    attempt.save(update_fields=fields)
    job = Job.objects.get(pk=attempt.job_id)
    name = Node.objects.values_list("name", flat=True).get(pk=node_id)
    _event(
        job,
        f"attempt {attempt.number}: its start on {name} at {_fmt(started)} was "
        "reported after the portal had ended it; recorded (the job stays "
        f"{job.status})",
        source=JobEvent.Source.AGENT,
    )
    assert attempt.started_at is not None and attempt.ended_at is not None
    hooks.accounting().runs_changed(
        _gpus(attempt), attempt.started_at, attempt.ended_at
    )
    return True


def late_exit(attempt: Attempt, node_id: int, data: protocol.JobExitedData) -> bool:
    """The agent's exit of an attempt the portal ended (lost node, given-up
    launch): its real end replaces the portal's estimate, the slots' release moves
    with it and the GPU time is charged again. The job's state does not change.
    Returns whether the end (and the charge) changed: False for a replay, or an
    exit that moves nothing (recorded all the same).

    A job spanning nodes ends when its last rank does: while a rank has not
    reported, the estimate stands for it (the end only moves later); once all
    have, the end is the last rank's."""
    key = str(node_id)
    if key in attempt.rank_exits:
        return False
    assert attempt.ended_at is not None
    old_end = attempt.ended_at
    attempt.rank_exits = {**attempt.rank_exits, key: data.model_dump(mode="json")}
    # A rank that never ran (its launch never arrived, its port was busy) says
    # when it answered, not when anything stopped running.
    ends = [
        _ts(float(e["ended_at"]))
        for e in attempt.rank_exits.values()
        if e.get("reason") not in NOTHING_RAN
    ]
    if len(attempt.rank_exits) >= len(attempt.node_ids) and ends:
        new_end = max(ends)
    else:
        new_end = max([old_end, *ends])
    if attempt.started_at is not None and new_end < attempt.started_at:
        new_end = attempt.started_at
    correct_attempt_end(attempt, new_end, data.exit_code)
    job = Job.objects.get(pk=attempt.job_id)
    name = Node.objects.values_list("name", flat=True).get(pk=node_id)
    what = f"exit on {name} ({data.reason}, exit code {data.exit_code})"
    if new_end == old_end:
        _event(
            job,
            f"attempt {attempt.number}: {what} reported after the portal had ended "
            f"it at {_fmt(old_end)}; recorded (the job stays {job.status})",
            source=JobEvent.Source.AGENT,
        )
        return False  # its end and charge stand
    before = _charged_hours(attempt)
    # Released when it really stopped: the invariant the charging's neighbour
    # lookups rely on (an ended attempt's slots are released at its end).
    Allocation.objects.filter(attempt=attempt).update(released_at=new_end)
    hooks.accounting().runs_changed(
        _gpus(attempt) if attempt.started_at is not None else [],
        min(old_end, new_end),
        max(old_end, new_end),
    )
    after = _charged_hours(attempt)
    _event(
        job,
        f"attempt {attempt.number}: {what} reported after the portal had ended "
        f"it: it ran until {_fmt(new_end)}, not {_fmt(old_end)}; GPU time charged "
        f"again: {before:.3f} -> {after:.3f} GPU-h (the job stays {job.status})",
        source=JobEvent.Source.AGENT,
    )
    return True
