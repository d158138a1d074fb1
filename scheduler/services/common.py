"""Helpers every verb shares: job events, timestamps, after-commit passes, kill
frames, and the errors the verbs raise.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any, cast, get_args

from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError

from agents import protocol
from scheduler import events
from scheduler.models import Attempt, Job, JobEvent

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from django.contrib.auth.models import User

log = logging.getLogger(__name__)


class JobStateError(Exception):
    """The job is not in a state that allows this action; ``str()`` says why."""


class FrameRefused(Exception):
    """A valid frame this node may not send (e.g. about another node's job); the
    consumer answers with an ``error`` frame saying ``str()``, and acks it."""


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


def _pass_after_commit() -> None:
    """Ask for a scheduling pass once the current transaction commits: once,
    however many changes of the atomic blocks now open ask (a request registered
    in all of them is already there)."""
    connection = transaction.get_connection()
    open_blocks = set(connection.savepoint_ids)
    if not any(
        func is request_pass and open_blocks <= sids
        for sids, func, _ in connection.run_on_commit
    ):
        transaction.on_commit(request_pass)


def request_pass() -> None:
    """Enqueue a scheduling pass, unless one is already queued and not yet begun
    (``pass_requests.claim_pass_request``: it will see this change); with the broker
    (Redis) down, log it and go on: the change is committed, and beat's next
    trigger runs the pass."""
    from scheduler.pass_requests import claim_pass_request, schedule_pass

    try:
        if claim_pass_request():
            schedule_pass.delay()
    except (KombuOperationalError, RedisError, OSError) as exc:
        log.error("broker unavailable; pass not enqueued (beat will run one): %r", exc)


def kill_frame(
    attempt_id: int,
    job_id: int,
    reason: protocol.KillReason,
    grace_s: int,
    signal: protocol.KillSignal = "TERM",
) -> dict[str, Any]:
    return events.frame(
        protocol.JobKill,
        protocol.JobKillData(
            attempt_id=attempt_id,
            job_id=job_id,
            reason=reason,
            grace_s=grace_s,
            signal=signal,
        ),
    )


# The scheduler's stops that requeue a job: a checkpointable job gets its
# checkpoint signal and grace for them, so it saves its work before it goes.
CHECKPOINT_KILLS: frozenset[str] = frozenset({"preempted", "evicted"})


def kill_terms(job: Job, reason: str) -> tuple[int, protocol.KillSignal]:
    """The grace and first signal of a kill of ``job`` for ``reason``: its
    checkpoint signal and grace for a checkpointable job the scheduler stops to
    requeue (``CHECKPOINT_KILLS``), else SIGTERM and its stop grace."""
    if job.checkpointable and reason in CHECKPOINT_KILLS:
        name = job.checkpoint_signal
        if name in get_args(protocol.KillSignal):
            return job.checkpoint_grace_s, cast("protocol.KillSignal", name)
    return job.kill_grace_s, "TERM"


def stored_kill_reason(value: str) -> protocol.KillReason:
    """An attempt's stored ``kill_reason`` as the protocol's (``stale`` if unknown)."""
    if value in get_args(protocol.KillReason):
        return cast("protocol.KillReason", value)
    return "stale"


def _send_kill_on_commit(
    attempt: Attempt,
    reason: protocol.KillReason,
    grace_s: int,
    *,
    signal: protocol.KillSignal = "TERM",
    skip: int | None = None,
    nodes: Iterable[int] | None = None,
) -> None:
    """After commit, ask every node of the attempt whose rank has not exited (but
    ``skip``; only ``nodes`` if given) to stop it, and record when
    (``kill_sent_at``): ``services.resend_kills`` sends the kill again if no exit
    comes back (the send may be lost: a process dying between the commit and the
    send, an agent not connected at that moment)."""
    command = kill_frame(attempt.pk, attempt.job_id, reason, grace_s, signal)
    only = None if nodes is None else set(nodes)
    for node_id in attempt.node_ids:
        if node_id == skip or str(node_id) in attempt.rank_exits:
            continue
        if only is not None and node_id not in only:
            continue
        transaction.on_commit(partial(events.send_to_agent, node_id, command))
    attempt.kill_sent_at = timezone.now()
    attempt.save(update_fields=["kill_sent_at"])


def _send_kills_on_commit(
    kills: Sequence[tuple[Attempt, int]], reason: protocol.KillReason
) -> None:
    """``_send_kill_on_commit`` of many attempts at once, each ``(attempt,
    grace_s)`` stopped with SIGTERM for ``reason`` (an array's cancel): every
    frame in one after-commit send, ``kill_reason`` and ``kill_sent_at`` in one
    UPDATE."""
    if not kills:
        return
    commands = [
        (node_id, kill_frame(attempt.pk, attempt.job_id, reason, grace_s))
        for attempt, grace_s in kills
        for node_id in attempt.node_ids
        if str(node_id) not in attempt.rank_exits
    ]
    if commands:
        transaction.on_commit(partial(events.send_to_agents, commands))
    now = timezone.now()
    Attempt.objects.filter(pk__in=[a.pk for a, _ in kills]).update(
        kill_reason=reason, kill_sent_at=now
    )
    for attempt, _ in kills:
        attempt.kill_reason = reason
        attempt.kill_sent_at = now
