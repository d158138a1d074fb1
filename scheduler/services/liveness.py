"""The portal's backstops, run by beat: nodes silent too long are lost (their jobs
requeued or failed exactly once), attempts past their time limit are stopped,
launches that never arrived are sent again (and given up after a bound), kills
no exit answered are sent again.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from scheduler import events
from scheduler.lifecycle import node_lost, relaunch
from scheduler.models import Attempt, Job, JobEvent, Node
from scheduler.services.attempts import launch_resent_message
from scheduler.services.common import (
    _event,
    _pass_after_commit,
    _send_kill_on_commit,
    kill_terms,
    stored_kill_reason,
)
from scheduler.services.lifecycle import end_attempt, transition, unlaunched_attempts
from scheduler.services.presence import hearing_since, set_node_status
from scheduler.services.starts import rank_launch

log = logging.getLogger(__name__)


def mark_lost_nodes(now: datetime | None = None) -> list[int]:
    """Mark UP nodes the portal has not heard for ``GPULAB_NODE_LOST_AFTER`` s as
    LOST and requeue (or fail) their jobs, exactly once per node (row lock +
    status check).

    Only time the portal could hear counts (``presence.hearing_since``): while no
    web process pulses, nobody is judged; after such a gap every node's silence
    is counted from the end of the gap, so a portal outage (web, PostgreSQL, or
    all of it) longer than the timeout requeues nothing that kept running."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER)
    since = hearing_since(now)
    if since is not None and since > cutoff:
        if Node.objects.filter(status=Node.Status.UP, last_seen_at__lt=cutoff).exists():
            log.warning(
                "nodes silent for %d s are not judged lost: the portal has heard "
                "its agents only since %s",
                settings.GPULAB_NODE_LOST_AFTER,
                since,
            )
        return []
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
            set_node_status(node, Node.Status.LOST, connected=False)
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
                end_attempt(
                    attempt,
                    max(ended, attempt.started_at or ended),
                    Attempt.Outcome.NODE_LOST,
                    None,
                )
                verdict = node_lost(
                    node.name,
                    cancel_requested=job.cancel_requested_at is not None,
                    requeue_on_node_loss=job.requeue_on_node_loss,
                )
                transition(
                    job,
                    verdict.to,
                    verdict.cause,
                    verdict.message,
                    source=JobEvent.Source.SYSTEM,
                    at=now,
                )
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


def resend_launches(now: datetime | None = None) -> list[int]:
    """Re-send lost launches: the portal's backstop for a ``job.launch`` that never
    reached a connected agent (a dropped channel-layer message, an agent mid-
    reconnect), which would leave the job STARTING, or the other ranks of a job
    spanning nodes waiting at the rendezvous, forever.

    1. A live attempt (not being stopped or cancelled) whose launch or last round
       of re-sends (``launch_resent_at``) is ``GPULAB_LAUNCH_RESEND_AFTER`` s old
       and that has ranks on UP, connected nodes with neither a start
       (``rank_starts``) nor an exit (``rank_exits``): each such rank gets its
       ``job.launch`` again (the agent ignores a launch it already has, answering
       with its start or exit), with a job event saying so; the round is counted
       in ``launch_resends``. At most one round per that delay, whatever the beat.
    2. Still silent that long after ``GPULAB_LAUNCH_RESENDS`` rounds: the attempt
       is given up (``_give_up``).
    Only the attempt's fields decide; the job events are its timeline, never read.
    A disconnected node's ranks wait: its hello re-sends their launches.
    Returns the ids of the attempts acted on.
    """
    now = now or timezone.now()
    delay = timedelta(seconds=settings.GPULAB_LAUNCH_RESEND_AFTER)
    candidates = list(
        Attempt.objects.filter(
            ended_at__isnull=True,
            kill_reason="",
            created_at__lte=now - delay,
            job__cancel_requested_at__isnull=True,
        )
        .filter(Q(launch_resent_at__isnull=True) | Q(launch_resent_at__lte=now - delay))
        .filter(Q(started_at__isnull=True) | ~Q(ranks=[]))
    )
    if not candidates:
        return []
    connected = set(
        Node.objects.filter(
            pk__in={n for a in candidates for n in a.node_ids},
            status=Node.Status.UP,
            connected=True,
        ).values_list("pk", flat=True)
    )
    acted = []
    for attempt in candidates:
        if _silent_ranks(attempt, connected, now, delay) and (
            _resend_or_give_up(attempt.pk, now, delay)
        ):
            acted.append(attempt.pk)
    return acted


def _silent_ranks(
    attempt: Attempt, connected: set[int], now: datetime, delay: timedelta
) -> list[int]:
    """Ranks of the attempt on connected nodes with neither a start nor an exit,
    if its launch or last round of re-sends is ``delay`` old (else none).

    A spanning attempt already live at migration 0007 has empty ``rank_starts``
    (its ranks' starts were only job events): each of its ranks gets one re-send,
    which is harmless, as the agent answers a launch of an attempt it runs with
    its start (then recorded) and never starts a second process."""
    if now - (attempt.launch_resent_at or attempt.created_at) < delay:
        return []
    return [
        rank
        for rank, node_id in enumerate(attempt.node_ids)
        if node_id in connected
        and str(node_id) not in attempt.rank_exits
        and not attempt.rank_started(node_id)
    ]


def _resend_or_give_up(attempt_id: int, now: datetime, delay: timedelta) -> bool:
    """Re-check the attempt under its lock (a start may have come in, another
    check may have re-sent already), then re-send or give up. True if it did."""
    with transaction.atomic():
        attempt = (
            Attempt.objects.select_for_update()
            .filter(pk=attempt_id, ended_at__isnull=True, kill_reason="")
            .first()
        )
        if attempt is None:
            return False
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        if job.cancel_requested_at is not None:
            return False
        attempt.job = job
        nodes = Node.objects.in_bulk(attempt.node_ids)
        connected = {
            pk
            for pk, node in nodes.items()
            if node.status == Node.Status.UP and node.connected
        }
        silent = _silent_ranks(attempt, connected, now, delay)
        if not silent:
            return False
        limit = settings.GPULAB_LAUNCH_RESENDS
        if attempt.launch_resends >= limit:
            _give_up(attempt, job, silent[0], nodes[attempt.node_ids[silent[0]]], now)
            return True
        attempt.launch_resends += 1
        attempt.launch_resent_at = now
        attempt.save(update_fields=["launch_resends", "launch_resent_at"])
        waited = int((now - attempt.created_at).total_seconds())
        for rank in silent:
            node = nodes[attempt.node_ids[rank]]
            _event(
                job,
                launch_resent_message(
                    attempt,
                    rank,
                    node.name,
                    f"no start reported {waited} s after the launch; "
                    f"re-send {attempt.launch_resends} of {limit}",
                ),
                source=JobEvent.Source.SYSTEM,
                at=now,
            )
            transaction.on_commit(
                partial(events.send_to_agent, node.pk, rank_launch(attempt, node.pk))
            )
            log.warning(
                "attempt %d rank %d: no start from %s; launch re-sent (%d of %d)",
                attempt.pk,
                rank,
                node.name,
                attempt.launch_resends,
                limit,
            )
    return True


def _give_up(attempt: Attempt, job: Job, rank: int, node: Node, now: datetime) -> None:
    """A rank never started although its launch was re-sent: stop every rank that
    may run (``stale``), end the attempt (``launch_lost``: its GPUs are free now)
    and relaunch the job, or fail it past ``GPULAB_RELAUNCH_MAX`` (attempt and job
    locked)."""
    _send_kill_on_commit(attempt, "stale", job.kill_grace_s)
    end_attempt(
        attempt,
        max(now, attempt.started_at or now),
        Attempt.Outcome.LAUNCH_LOST,
        None,
    )
    if job.status not in Job.ON_NODE:  # the job moved on already: nothing to relaunch
        return
    who = f"rank {rank} of attempt" if len(attempt.node_ids) > 1 else "attempt"
    verdict = relaunch(
        f"{who} {attempt.number} on {node.name} reported no start after "
        f"{attempt.launch_resends} re-sent launches",
        unlaunched_attempts(job),
        settings.GPULAB_RELAUNCH_MAX,
    )
    transition(
        job,
        verdict.to,
        verdict.cause,
        verdict.message,
        source=JobEvent.Source.SYSTEM,
        at=now,
    )
    log.warning("job %d: %s", job.pk, verdict.message)


def resend_kills(now: datetime | None = None) -> list[int]:
    """Re-send lost kills: the portal's backstop for a ``job.kill`` that never
    reached the agent (the web or worker process died between the commit that
    asked for it and the send, the agent was reconnecting), which would leave a
    job being stopped (cancelled, requeued, preempted, evicted, at its quota or
    time limit, stale) running on its GPU.

    A live attempt being stopped (``kill_reason``) whose kill went out
    ``kill_grace_s + GPULAB_KILL_RESEND_AFTER`` s ago (its exit is overdue) gets
    it again, under its row lock, on each of its nodes that is UP and connected
    and whose rank has not exited; ``kill_sent_at`` and ``kill_resends`` record
    it, a job event says so the first time, a log line every time. Unbounded:
    the agent answers a kill of an attempt it has finished or never had with its
    exit (``never_started``), and its shim signals the job's processes once
    whatever the number of kills, so a repeat is harmless, while giving up would
    leave the GPU held. An attempt with no such node waits: a node's hello
    re-sends the kill of what its agent still runs. Returns the attempt ids."""
    now = now or timezone.now()
    delay = timedelta(seconds=settings.GPULAB_KILL_RESEND_AFTER)
    candidates = list(
        Attempt.objects.filter(ended_at__isnull=True)
        .exclude(kill_reason="")
        .filter(Q(kill_sent_at__isnull=True) | Q(kill_sent_at__lte=now - delay))
        .values_list("pk", flat=True)
    )
    return [pk for pk in candidates if _resend_kill(pk, now, delay)]


def _resend_kill(attempt_id: int, now: datetime, delay: timedelta) -> bool:
    """Re-check the attempt under its lock (its exit may have come in, another
    check may have re-sent), then re-send its kill. True if it did."""
    with transaction.atomic():
        attempt = (
            Attempt.objects.select_for_update()
            .filter(pk=attempt_id, ended_at__isnull=True)
            .exclude(kill_reason="")
            .select_related("job")
            .first()
        )
        if attempt is None:
            return False
        job = attempt.job
        reason = stored_kill_reason(attempt.kill_reason)
        grace, signal = kill_terms(job, reason)
        sent = attempt.kill_sent_at
        if sent is not None and now - sent < delay + timedelta(seconds=grace):
            return False
        waiting = [n for n in attempt.node_ids if str(n) not in attempt.rank_exits]
        nodes = list(
            Node.objects.filter(
                pk__in=waiting, status=Node.Status.UP, connected=True
            ).order_by("name")
        )
        if not nodes:
            return False
        _send_kill_on_commit(
            attempt, reason, grace, signal=signal, nodes=[n.pk for n in nodes]
        )
        attempt.kill_sent_at = now
        attempt.kill_resends += 1
        attempt.save(update_fields=["kill_sent_at", "kill_resends"])
        names = ", ".join(n.name for n in nodes)
        if attempt.kill_resends == 1:
            waited = "" if sent is None else f" {int((now - sent).total_seconds())} s"
            _event(
                job,
                f"attempt {attempt.number}: no exit reported{waited} after its kill"
                f" ({attempt.kill_reason}); kill re-sent to {names}",
                source=JobEvent.Source.SYSTEM,
                at=now,
            )
        log.warning(
            "attempt %d of job %d: no exit after its kill (%s); kill re-sent to %s"
            " (%d)",
            attempt.pk,
            job.pk,
            attempt.kill_reason,
            names,
            attempt.kill_resends,
        )
    return True
