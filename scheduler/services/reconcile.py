"""The reconciler: what the agents say they hold against what the database says
runs, and the repair of any drift (beat, ``scheduler.tasks.reconcile``).

Evidence. Every heartbeat and hello lists the attempts the agent holds (running, or
ended with the exit not yet acknowledged); ``record_report`` (``presence``) keeps,
per node, when it last reported (``AgentReport``) and, per attempt, when it was last
listed (``AgentSighting``). An attempt is *held now* when it was in the node's
latest report.

Repairs, each with a job event, each at most once however many reconcilers run:

1. **Stale** (a job running on a node the database thinks is free): an attempt the
   node holds now although the portal ended it, or gave it to another node (or
   the rank of this node already exited). First noticed (``stale_since``); still
   held ``GPULAB_RECONCILE_GRACE`` s later (so not an exit on its way), the node
   is sent ``job.kill`` (``stale``) once, with a job event (``killed_at`` set by
   compare-and-swap); re-sent without an event while it is still held a grace
   later. An attempt id the portal never made has no job to tell: it is logged,
   and the agent's next hello kills it.
2. **Lost** (the database thinks an attempt runs but its agent does not have it):
   a started rank (its start reported) on an UP, connected node whose latest
   report, made at least a grace after the last time the attempt was listed (or
   started, if never listed), lacks it. Under the attempt's row lock, re-checked:
   a job event, then the rank's exit as ``lost`` through ``finish_attempt``
   (ended at the last time it was listed, so charged only for time it was seen to
   run; the job is requeued, or failed when it asked not to be). Attempts never
   started are ``resend_launches``'s (re-sent, then given up).

Nodes that stopped reporting are left to ``mark_lost_nodes``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents import protocol
from scheduler import events
from scheduler.models import AgentReport, AgentSighting, Attempt, JobEvent, Node
from scheduler.services.attempts import finish_attempt
from scheduler.services.common import _event, kill_frame

log = logging.getLogger(__name__)

# Sightings of attempts that no longer run, not refreshed for this long, are
# forgotten.
FORGET_AFTER = timedelta(hours=1)


def reconcile(now: datetime | None = None) -> dict[str, list[int]]:
    """One reconciliation of every reporting node; returns the attempts repaired
    (``stale``: kill sent, ``lost``: ended)."""
    now = now or timezone.now()
    grace = timedelta(seconds=settings.GPULAB_RECONCILE_GRACE)
    reports = dict(
        AgentReport.objects.filter(
            reported_at__gte=now - grace,
            node__connected=True,
            node__status=Node.Status.UP,
        ).values_list("node_id", "reported_at")
    )
    result: dict[str, list[int]] = {"stale": [], "lost": []}
    if reports:
        sightings = list(AgentSighting.objects.filter(node_id__in=list(reports)))
        result["stale"] = _stale(sightings, reports, now, grace)
        result["lost"] = _lost(sightings, reports, grace)
    AgentSighting.objects.filter(last_seen_at__lt=now - FORGET_AFTER).exclude(
        attempt_id__in=Attempt.objects.filter(ended_at__isnull=True).values("pk")
    ).delete()
    return result


# ------------------------------------------------------------------ stale


def _held_by_mistake(sighting: AgentSighting, attempt: Attempt | None) -> bool:
    if attempt is None or attempt.ended_at is not None:
        return True
    node = sighting.node_id
    return node not in attempt.node_ids or str(node) in attempt.rank_exits


def _stale(
    sightings: list[AgentSighting],
    reports: dict[int, datetime],
    now: datetime,
    grace: timedelta,
) -> list[int]:
    held = [s for s in sightings if s.last_seen_at == reports[s.node_id]]
    attempts = Attempt.objects.select_related("job").in_bulk(
        [s.attempt_id for s in held]
    )
    killed = []
    for sighting in held:
        attempt = attempts.get(sighting.attempt_id)
        if not _held_by_mistake(sighting, attempt):
            if sighting.stale_since is not None:  # it was an exit on its way
                AgentSighting.objects.filter(pk=sighting.pk).update(
                    stale_since=None, killed_at=None
                )
            continue
        if sighting.stale_since is None:
            AgentSighting.objects.filter(pk=sighting.pk, stale_since=None).update(
                stale_since=now
            )
            continue
        if now - sighting.stale_since < grace:
            continue
        if attempt is None:
            if sighting.killed_at is None and _mark_killed(sighting, now, None):
                log.warning(
                    "reconciler: node %d holds attempt %d, which the portal never"
                    " made; its agent's next hello stops it",
                    sighting.node_id,
                    sighting.attempt_id,
                )
            continue
        if sighting.killed_at is not None and now - sighting.killed_at < grace:
            continue
        if _kill_stale(sighting, attempt, now):
            killed.append(attempt.pk)
    return killed


def _mark_killed(
    sighting: AgentSighting, now: datetime, previous: datetime | None
) -> bool:
    """Compare-and-swap ``killed_at`` from ``previous`` to ``now``: True for the one
    reconciler that wins (the row lock makes a concurrent one re-read it)."""
    return bool(
        AgentSighting.objects.filter(pk=sighting.pk, killed_at=previous).update(
            killed_at=now
        )
    )


def _kill_stale(sighting: AgentSighting, attempt: Attempt, now: datetime) -> bool:
    """Tell the node to stop the attempt it should not hold: the first time with a
    job event, later (still held a grace after) as a plain re-send."""
    first = sighting.killed_at is None
    with transaction.atomic():
        if not _mark_killed(sighting, now, sighting.killed_at):
            return False  # another reconciler did it
        node = Node.objects.values_list("name", flat=True).get(pk=sighting.node_id)
        if first:
            if attempt.ended_at is not None:
                why = f"which ended ({attempt.outcome or 'ended'})"
            elif sighting.node_id not in attempt.node_ids:
                why = "which is not allocated to it"
            else:
                why = "whose rank there already exited"
            _event(
                attempt.job,
                f"reconciler: node {node} still runs attempt {attempt.number}, {why};"
                " told to stop it (stale)",
                source=JobEvent.Source.SYSTEM,
                at=now,
            )
        command = kill_frame(
            attempt.pk, attempt.job_id, "stale", attempt.job.kill_grace_s
        )
        transaction.on_commit(partial(events.send_to_agent, sighting.node_id, command))
    log.warning(
        "reconciler: node %s holds attempt %d of job %d (%s); kill %s",
        node,
        attempt.pk,
        attempt.job_id,
        "ended" if attempt.ended_at else "not its own",
        "sent" if first else "re-sent",
    )
    return True


# ------------------------------------------------------------------ lost


def _rank_start(attempt: Attempt, node_id: int) -> datetime | None:
    start = attempt.rank_starts.get(str(node_id))
    if start is not None:
        return datetime.fromtimestamp(float(start["started_at"]), tz=UTC)
    if not attempt.ranks and attempt.started_at is not None:
        return attempt.started_at
    return None


def _missing_since(
    attempt: Attempt,
    node_id: int,
    seen: dict[tuple[int, int], datetime],
    reports: dict[int, datetime],
    grace: timedelta,
) -> datetime | None:
    """When the node's agent last showed the attempt's rank, if its latest report
    (at least a grace later) lacks it; None when it holds it or may still."""
    if str(node_id) in attempt.rank_exits:
        return None
    started = _rank_start(attempt, node_id)
    if started is None:
        return None  # never started there: resend_launches' business
    last = seen.get((node_id, attempt.pk))
    if last is not None and last >= reports[node_id]:
        return None  # held now
    evidence = max(started, last) if last is not None else started
    if reports[node_id] - evidence < grace:
        return None
    return evidence


def _lost(
    sightings: list[AgentSighting],
    reports: dict[int, datetime],
    grace: timedelta,
) -> list[int]:
    seen = {(s.node_id, s.attempt_id): s.last_seen_at for s in sightings}
    nodes = list(reports)
    # Ranks on other nodes are attempts spanning nodes (few): read them all.
    live = Attempt.objects.filter(
        Q(node_id__in=nodes) | ~Q(ranks=[]),
        ended_at__isnull=True,
        started_at__isnull=False,
    )
    ended = []
    for attempt in live:
        for node_id in attempt.node_ids:
            if node_id not in reports:
                continue
            since = _missing_since(attempt, node_id, seen, reports, grace)
            if since is not None and _end_lost(attempt.pk, node_id, grace):
                ended.append(attempt.pk)
                break
    return ended


def _end_lost(attempt_id: int, node_id: int, grace: timedelta) -> bool:
    """End the rank as lost, re-checking everything under the attempt's lock (a
    concurrent reconciler, a late exit or a new report may have come first)."""
    with transaction.atomic():
        attempt = (
            Attempt.objects.select_for_update()
            .filter(pk=attempt_id, ended_at__isnull=True)
            .select_related("job")
            .first()
        )
        if attempt is None:
            return False
        node = Node.objects.get(pk=node_id)
        report = AgentReport.objects.filter(node_id=node_id).first()
        if report is None or node.status != Node.Status.UP or not node.connected:
            return False
        last = (
            AgentSighting.objects.filter(node_id=node_id, attempt_id=attempt_id)
            .values_list("last_seen_at", flat=True)
            .first()
        )
        seen = {(node_id, attempt_id): last} if last is not None else {}
        since = _missing_since(
            attempt, node_id, seen, {node_id: report.reported_at}, grace
        )
        if since is None:
            return False
        rank = (
            f"attempt {attempt.number}"
            if len(attempt.node_ids) == 1
            else f"rank {attempt.node_ids.index(node_id)} of attempt {attempt.number}"
        )
        _event(
            attempt.job,
            f"reconciler: the agent of {node.name} has not listed {rank} since"
            f" {since:%Y-%m-%d %H:%M:%S} UTC (it does not run it); ending it as lost",
            source=JobEvent.Source.SYSTEM,
        )
        ended = finish_attempt(
            node_id,
            protocol.JobExitedData(
                attempt_id=attempt.pk,
                job_id=attempt.job_id,
                exit_code=None,
                ended_at=since.timestamp(),
                reason="lost",
                message="process no longer held by the node's agent (reconciler)",
            ),
        )
    if ended:
        log.warning(
            "reconciler: %s of job %d not held by %s since %s; ended as lost",
            rank,
            attempt.job_id,
            node.name,
            since,
        )
    return ended
