"""Node presence: an agent's authentication, its hello (the node's facts and the
reconciliation of its jobs), heartbeats and what they say the agent holds, its
disconnection; ``set_node_status``, the only writer of a node's state; and the
web tier's pulse (``pulse_hearing``), the record of when the portal could hear
its agents at all.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from agents import protocol
from scheduler.models import Attempt, Gpu, Node, PortalHearing, hash_token
from scheduler.services.common import (
    _pass_after_commit,
    kill_frame,
    kill_terms,
    stored_kill_reason,
)
from scheduler.services.starts import rank_launch

if TYPE_CHECKING:
    from collections.abc import Iterable
    from datetime import datetime

log = logging.getLogger(__name__)

# A node's states: NEW -> UP at its first hello, UP -> LOST when it stays silent
# (``liveness.mark_lost_nodes``), LOST -> UP at its next hello; a hello of an UP
# node keeps it UP.
NODE_TRANSITIONS = frozenset(
    {
        (Node.Status.NEW, Node.Status.UP),
        (Node.Status.UP, Node.Status.UP),
        (Node.Status.LOST, Node.Status.UP),
        (Node.Status.UP, Node.Status.LOST),
    }
)


def set_node_status(node: Node, status: Node.Status, **changes: Any) -> None:
    """Move a node (locked by the caller) to ``status``, saving ``changes`` (other
    fields of the node) with it; ``ValueError`` for a change
    ``NODE_TRANSITIONS`` does not allow, nothing saved."""
    if (node.status, status) not in NODE_TRANSITIONS:
        raise ValueError(f"node {node.name}: {node.status} -> {status} is not allowed")
    node.status = status
    for name, value in changes.items():
        setattr(node, name, value)
    node.save(update_fields=["status", *changes])


def authenticate_node(token: str) -> Node | None:
    """The node whose token this is, or None. The lookup is by hash (unique index);
    ``check_token`` then compares in constant time."""
    if not token or len(token) > 512:
        return None
    node = Node.objects.filter(token_hash=hash_token(token)).first()
    if node is None or not node.check_token(token):
        return None
    return node


class HelloResult(NamedTuple):
    commands: list[dict[str, Any]]
    rejected: list[str]


def record_hello(node_id: int, hello: protocol.HelloData) -> HelloResult:
    """Record a node's facts and reconcile its jobs; return commands for its agent.

    1. Lock the node; update its facts; it is UP and connected.
    2. Upsert its GPUs by index; GPUs missing from the hello are marked not present.
    3. Reconcile: a live attempt of this node that the agent does not run and that
       never started is launched again (``job.launch`` is idempotent by attempt id);
       an attempt the agent runs that is being stopped (``kill_reason``) gets its
       kill again (it may have been sent while the agent was away); an attempt the
       agent runs that the portal has ended (or never made) is killed as stale, so
       a job never runs twice.
    """
    commands: list[dict[str, Any]] = []
    rejected: list[str] = []
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        now = timezone.now()
        was_lost = node.status == Node.Status.LOST
        set_node_status(
            node,
            Node.Status.UP,
            connected=True,
            last_seen_at=now,
            hostname=hello.hostname[:255],
            driver_version=(hello.driver_version or "")[:64],
            cuda_version=(hello.cuda_version or "")[:64],
            agent_version=hello.agent_version[:64],
            incarnation=hello.incarnation,
        )
        if was_lost:
            log.info("node %s is back after being lost", node.name)

        existing = {g.index: g for g in node.gpus.all()}
        taken = dict(
            Gpu.objects.filter(uuid__in=[i.uuid for i in hello.gpus])
            .exclude(node=node)
            .values_list("uuid", "node__name")
        )
        seen = set()
        for info in hello.gpus:
            if info.uuid in taken:
                # Two nodes cannot hold one GPU: refuse it, keep the rest.
                rejected.append(
                    f"GPU {info.index} ({info.uuid}) is registered to node "
                    f"{taken[info.uuid]}"
                )
                continue
            seen.add(info.index)
            gpu = existing.get(info.index)
            if gpu is None:
                gpu = Gpu(
                    node=node, index=info.index, slots=settings.GPULAB_GPU_JOB_LIMIT
                )
            gpu.uuid = info.uuid
            gpu.name = info.name
            gpu.memory_total_mib = info.memory_total_mib
            gpu.nvlink_peers = list(info.nvlink_peers)
            gpu.topology = [link.model_dump() for link in info.topology]
            gpu.mig_enabled = info.mig_enabled
            gpu.present = True
            gpu.save()
        for index, gpu in existing.items():
            if index not in seen and gpu.present:
                gpu.present = False
                gpu.save(update_fields=["present"])

        running = {r.attempt_id for r in hello.running}
        live = list(
            Attempt.objects.filter(ended_at__isnull=True)
            .filter(Q(node=node) | Q(ranks__contains=[node.pk]))
            .select_related("job")
        )
        stopping = []
        for attempt in live:
            if str(node.pk) in attempt.rank_exits:
                continue
            if attempt.pk in running:
                if attempt.kill_reason:
                    # Being stopped, yet running: its kill may have been lost
                    # (sent while the agent was away); the agent signals a job
                    # once, so a repeat is harmless.
                    stopping.append(attempt.pk)
                    reason = stored_kill_reason(attempt.kill_reason)
                    grace, signal = kill_terms(attempt.job, reason)
                    commands.append(
                        kill_frame(attempt.pk, attempt.job_id, reason, grace, signal)
                    )
                continue
            spans = len(attempt.node_ids) > 1
            if (attempt.started_at is None or spans) and (
                attempt.job.cancel_requested_at is None
            ):
                if attempt.kill_reason:
                    # Being stopped (a peer failed, preempted...): never launch it
                    # again; the kill of an attempt the agent does not run comes
                    # back as its exit (never_started), so the attempt can end.
                    commands.append(
                        kill_frame(
                            attempt.pk,
                            attempt.job_id,
                            stored_kill_reason(attempt.kill_reason),
                            attempt.job.kill_grace_s,
                        )
                    )
                    continue
                # Never launched here (or this rank's launch was lost): launch is
                # idempotent by attempt id on the agent.
                commands.append(rank_launch(attempt, node.pk))
            elif attempt.job.cancel_requested_at is not None:
                commands.append(
                    kill_frame(
                        attempt.pk,
                        attempt.job_id,
                        "cancelled",
                        attempt.job.kill_grace_s,
                    )
                )
        if stopping:
            Attempt.objects.filter(pk__in=stopping).update(kill_sent_at=now)
            log.info("node %s hello: kill re-sent for attempts %s", node.name, stopping)
        record_report(node.pk, running, now)
        live_ids = {a.pk for a in live}
        for job in hello.running:
            if job.attempt_id not in live_ids:
                commands.append(
                    kill_frame(
                        job.attempt_id, job.job_id, "stale", settings.GPULAB_KILL_GRACE
                    )
                )
    _pass_after_commit()
    for problem in rejected:
        log.error("node %s hello: %s", node.name, problem)
    return HelloResult(commands, rejected)


def record_heartbeat(node_id: int, held: Iterable[int] | None = None) -> str | None:
    """The node is alive; with ``held`` (the heartbeat's attempt ids), also what
    its agent holds (``record_report``). Returns the node's status (None: no such
    node): a LOST node's agent must say hello again to be reconciled."""
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE scheduler_node SET last_seen_at = %s, connected = true"
            " WHERE id = %s RETURNING status",
            [now, node_id],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    if held is not None:
        record_report(node_id, held, now)
    return str(row[0])


# The node's report time and the sightings of what it listed, in one statement
# (a heartbeat's only write besides the node's ``last_seen_at``).
_REPORT_SQL = """
WITH report AS (
    INSERT INTO scheduler_agentreport (node_id, reported_at)
    VALUES (%(node)s, %(now)s)
    ON CONFLICT (node_id) DO UPDATE SET reported_at = EXCLUDED.reported_at
)
INSERT INTO scheduler_agentsighting (node_id, attempt_id, first_seen_at, last_seen_at)
SELECT %(node)s, id, %(now)s, %(now)s FROM unnest(%(ids)s::bigint[]) AS t(id)
ON CONFLICT (node_id, attempt_id) DO UPDATE SET last_seen_at = EXCLUDED.last_seen_at
"""


def record_report(node_id: int, held: Iterable[int], now: datetime) -> None:
    """The node's agent holds exactly the attempts ``held`` at ``now`` (from a
    heartbeat or hello): the reconciler's evidence (``services.reconcile``)."""
    ids = sorted(set(held))[: protocol.MAX_HELD]
    with connection.cursor() as cursor:
        cursor.execute(_REPORT_SQL, {"node": node_id, "now": now, "ids": ids})


def record_disconnect(node_id: int) -> None:
    Node.objects.filter(pk=node_id).update(connected=False)


# ------------------------------------------------------------------ hearing


def hearing_gap() -> timedelta:
    """Pulses further apart than this mean the portal could not hear its agents
    in between (no web process serving, PostgreSQL unreachable): half of
    ``GPULAB_NODE_LOST_AFTER``, so an outage short enough to go unnoticed can
    never alone make a node look lost."""
    return timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER / 2)


def hearing_pulse_every() -> float:
    """Seconds between a web process's pulses: three per gap, at most 5 s."""
    return min(5.0, hearing_gap().total_seconds() / 3)


_PULSE_SQL = """
INSERT INTO scheduler_portalhearing AS h (id, heard_at, hearing_since)
VALUES (1, %(now)s, %(now)s)
ON CONFLICT (id) DO UPDATE SET
    hearing_since = CASE WHEN h.heard_at < %(now)s - make_interval(secs => %(gap)s)
                         THEN EXCLUDED.hearing_since ELSE h.hearing_since END,
    heard_at = GREATEST(h.heard_at, EXCLUDED.heard_at)
RETURNING hearing_since = %(now)s
"""


def pulse_hearing(now: datetime | None = None) -> bool:
    """A web process serving agents says the portal hears them (``PortalHearing``):
    ``heard_at`` is now; after a gap longer than ``hearing_gap`` (or at the first
    pulse ever) a new run of hearing starts now (``hearing_since``), so the
    silence of nodes during the gap is not counted against them. One statement:
    several web processes pulse the one row. True if a new run started."""
    now = now or timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(_PULSE_SQL, {"now": now, "gap": hearing_gap().total_seconds()})
        row = cursor.fetchone()
    started = bool(row and row[0])
    if started:
        log.info("the portal hears its agents again (pulse after a gap)")
    return started


def hearing_since(now: datetime) -> datetime | None:
    """Since when the portal has heard its agents without a gap, as of ``now``:
    the start of the current run of pulses; ``now`` itself (nothing heard yet)
    while the last pulse is older than ``hearing_gap``; None if no web process
    ever pulsed (a server without the ASGI lifespan): then heartbeats alone
    decide."""
    hearing = PortalHearing.objects.filter(pk=1).first()
    if hearing is None:
        return None
    if now - hearing.heard_at > hearing_gap():
        return now
    return hearing.hearing_since


async def hear_agents() -> None:
    """A web process's pulse loop (started by the ASGI lifespan, ``portal.asgi``):
    ``pulse_hearing`` every ``hearing_pulse_every`` s until cancelled. A pulse
    that fails (PostgreSQL down) is logged once per failing run and retried: the
    gap it leaves is the point."""
    from channels.db import DatabaseSyncToAsync

    # A thread of its own (not the one the consumers' database calls share):
    # with PostgreSQL down a pulse waits for a pooled connection, and must not
    # hold up the agents' frames meanwhile.
    pulse = DatabaseSyncToAsync(pulse_hearing, thread_sensitive=False)
    failing = False
    while True:
        try:
            await pulse()
        except Exception as exc:  # any failure is a missed pulse
            if not failing:
                log.error("hearing pulse failed (retrying): %r", exc)
            failing = True
        else:
            failing = False
        await asyncio.sleep(hearing_pulse_every())
