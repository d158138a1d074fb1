"""The portal's backstops, run by beat: nodes silent too long are lost (their jobs
requeued or failed exactly once), attempts past their time limit are stopped.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from scheduler.models import Attempt, Job, JobEvent, Node
from scheduler.services.agent_verbs import _end_attempt
from scheduler.services.common import (
    _after_commit_state_change,
    _event,
    _pass_after_commit,
    _send_kill_on_commit,
)

log = logging.getLogger(__name__)


def mark_lost_nodes(now: datetime | None = None) -> list[int]:
    """Mark UP nodes without a heartbeat for ``GPULAB_NODE_LOST_AFTER`` as LOST and
    requeue (or fail) their jobs, exactly once per node (row lock + status check)."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER)
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
            node.status = Node.Status.LOST
            node.connected = False
            node.save(update_fields=["status", "connected"])
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
                _end_attempt(
                    attempt,
                    max(ended, attempt.started_at or ended),
                    Attempt.Outcome.NODE_LOST,
                    None,
                )
                old = job.status
                if job.cancel_requested_at is not None:
                    job.status = Job.Status.CANCELLED
                elif job.requeue_on_node_loss:
                    job.status = Job.Status.PENDING
                else:
                    job.status = Job.Status.FAILED
                message = f"node {node.name} lost; job {job.status}"
                if job.status != Job.Status.PENDING:
                    job.finished_at = now
                    job.end_reason = message
                job.save(update_fields=["status", "finished_at", "end_reason"])
                _event(
                    job,
                    message,
                    source=JobEvent.Source.SYSTEM,
                    from_status=old,
                    to_status=job.status,
                )
                _after_commit_state_change(job, message)
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
