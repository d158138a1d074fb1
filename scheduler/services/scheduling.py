"""The scheduling pass's two ends around ``policy.decide``: ``cluster_state`` loads
what the policy needs in a fixed number of queries, ``apply_decisions`` applies its
Starts (``starts.py``), Preempts and Waits in one transaction.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from scheduler import classes, policy
from scheduler.models import (
    Allocation,
    Attempt,
    Gpu,
    Group,
    Job,
    JobEvent,
    Membership,
    Node,
)
from scheduler.services.common import _event, _send_kill_on_commit, _ts
from scheduler.services.starts import start_jobs

if TYPE_CHECKING:
    from collections.abc import Iterable


log = logging.getLogger(__name__)


def policy_config() -> policy.PolicyConfig:
    return policy.PolicyConfig(**settings.GPULAB_POLICY)


def class_specs() -> dict[str, policy.ClassSpec]:
    return {
        name: policy.ClassSpec(
            name=name,
            weight=c.weight,
            preemptible=c.preemptible,
            slowdown_cap=c.slowdown_cap,
        )
        for name, c in classes.all_classes().items()
    }


def decayed_usage(now: datetime) -> policy.Usage:
    """Each group's and user's GPU-seconds decayed with the fair-share half-life
    (``GPULAB_FAIRSHARE_HALF_LIFE``), running attempts counted up to ``now``, and
    their shares. Three queries, whatever the history's size."""
    half_life = float(settings.GPULAB_FAIRSHARE_HALF_LIFE)
    horizon = now - timedelta(seconds=half_life * 10)
    decay = "power(2.0, -extract(epoch from (%s - {end})) / %s)"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT g.name, u.username, sum(r.gpu_seconds * {decay.format(end="r.ended_at")})
            FROM scheduler_usagerecord r
            JOIN scheduler_group g ON g.id = r.group_id
            JOIN auth_user u ON u.id = r.user_id
            WHERE r.ended_at >= %s
            GROUP BY g.name, u.username
            UNION ALL
            SELECT g.name, u.username,
                   sum(extract(epoch from (%s - t.started_at)) / gpu.slots)
            FROM scheduler_allocation a
            JOIN scheduler_attempt t ON t.id = a.attempt_id
            JOIN scheduler_job j ON j.id = t.job_id
            JOIN scheduler_group g ON g.id = j.group_id
            JOIN auth_user u ON u.id = j.owner_id
            JOIN scheduler_gpu gpu ON gpu.id = a.gpu_id
            WHERE a.released_at IS NULL AND t.started_at IS NOT NULL
            GROUP BY g.name, u.username
            """,
            [now, half_life, horizon, now],
        )
        rows = cursor.fetchall()
    group_usage: dict[str, float] = {}
    user_usage: dict[tuple[str, str], float] = {}
    for group, user, used in rows:
        group_usage[group] = group_usage.get(group, 0.0) + float(used or 0.0)
        key = (group, user)
        user_usage[key] = user_usage.get(key, 0.0) + float(used or 0.0)
    group_shares = {g.name: float(g.shares) for g in Group.objects.all()}
    user_shares = {
        (group, user): float(shares)
        for group, user, shares in Membership.objects.values_list(
            "group__name", "user__username", "shares"
        )
    }
    return policy.Usage(group_usage, user_usage, group_shares, user_shares)


def cluster_state(now: datetime | None = None) -> policy.ClusterState:
    """Load what ``policy.decide`` needs in a fixed number of queries (never one
    per job): nodes, GPUs, live allocations, pending jobs, running attempts, usage."""
    now = now or timezone.now()
    specs = class_specs()
    nodes = list(Node.objects.all().only("id", "name", "status", "draining"))
    live = list(
        Allocation.objects.filter(released_at__isnull=True).values_list(
            "gpu_id", "attempt_id"
        )
    )
    used: dict[int, int] = {}
    gpus_of_attempt: dict[int, set[int]] = {}
    for gpu_id, attempt_id in live:
        used[gpu_id] = used.get(gpu_id, 0) + 1
        gpus_of_attempt.setdefault(attempt_id, set()).add(gpu_id)
    # Plain tuples, not model instances: building 50,000 ORM objects was most of
    # the pass at 10,000 pending jobs (bench/pass_scaling.py).
    gpu_rows = list(
        Gpu.objects.values_list(
            "pk",
            "node_id",
            "index",
            "memory_total_mib",
            "slots",
            "present",
            "mig_enabled",
            "name",
            "nvlink_peers",
            "topology",
        )
    )
    index_of = {row[0]: row[2] for row in gpu_rows}
    gpus = [
        policy.GpuView(
            id=pk,
            node_id=node_id,
            index=index,
            memory_total_mib=memory,
            slots=slots,
            free_slots=max(0, slots - used.get(pk, 0)),
            schedulable=present and not mig,
            model=name,
            nvlink_peers=tuple(int(p) for p in peers),
            topology=tuple((int(link["peer"]), int(link["level"])) for link in topo),
        )
        for (pk, node_id, index, memory, slots, present, mig, name, peers, topo) in (
            gpu_rows
        )
    ]
    pending = [
        policy.PendingJob(
            id=pk,
            gpus=n_gpus,
            gpu_memory_mib=memory,
            priority_weight=specs[pclass].weight if pclass in specs else 0.0,
            submitted_at=submitted.timestamp(),
            user=user,
            group=group,
            priority_class=pclass,
            time_limit_s=float(limit),
            planned_s=float(min(limit, predicted) if predicted else limit),
            shareable=shareable,
            gpu_model=model,
        )
        for (
            pk,
            n_gpus,
            memory,
            submitted,
            user,
            group,
            pclass,
            limit,
            predicted,
            shareable,
            model,
        ) in Job.objects.pending().values_list(
            "pk",
            "gpus",
            "gpu_memory_mib",
            "submitted_at",
            "owner__username",
            "group__name",
            "priority_class",
            "time_limit_s",
            "predicted_runtime_s",
            "shareable",
            "gpu_model",
        )
    ]
    running = []
    hour_ago = now - timedelta(hours=1)
    for (
        attempt_id,
        job_id,
        started,
        created,
        kill_reason,
        user,
        group,
        pclass,
        limit,
        predicted,
        preemptions,
        last_preempted,
    ) in Attempt.objects.filter(
        ended_at__isnull=True, pk__in=list(gpus_of_attempt)
    ).values_list(
        "pk",
        "job_id",
        "started_at",
        "created_at",
        "kill_reason",
        "job__owner__username",
        "job__group__name",
        "job__priority_class",
        "job__time_limit_s",
        "job__predicted_runtime_s",
        "job__preemptions",
        "job__last_preempted_at",
    ):
        spec = specs.get(pclass)
        running.append(
            policy.RunningJob(
                id=job_id,
                gpu_ids=tuple(
                    sorted(gpus_of_attempt[attempt_id], key=lambda g: index_of[g])
                ),
                started_at=(started or created).timestamp(),
                planned_s=float(min(limit, predicted) if predicted else limit),
                time_limit_s=float(limit),
                user=user,
                group=group,
                priority_class=pclass,
                # A job already being stopped is no candidate for preemption, and
                # its GPUs count as freeing now (no second set of victims).
                preemptible=bool(spec and spec.preemptible) and not kill_reason,
                stopping=bool(kill_reason),
                # Conservative: all its preemptions, if the last was within the hour.
                preemptions_last_hour=preemptions
                if last_preempted and last_preempted > hour_ago
                else 0,
            )
        )
    return policy.ClusterState(
        now=now.timestamp(),
        nodes=tuple(
            policy.NodeView(
                id=n.pk,
                name=n.name,
                schedulable=n.status == Node.Status.UP and not n.draining,
            )
            for n in nodes
        ),
        gpus=tuple(gpus),
        pending=tuple(pending),
        running=tuple(running),
        usage=decayed_usage(now),
        classes=specs,
        config=policy_config(),
    )


@dataclass
class ApplyResult:
    started: int = 0
    skipped: int = 0
    updated_reasons: int = 0
    preempted: int = 0
    # Wall time of each part, for the pass's log line and bench/pass_scaling.py.
    starts_ms: float = 0.0
    preempts_ms: float = 0.0
    waits_ms: float = 0.0


def apply_decisions(decisions: Iterable[policy.Decision]) -> ApplyResult:
    """Apply one pass's decisions in one transaction.

    1. The ``Start`` decisions together (``start_jobs``): lock the jobs (must still
       be PENDING) and their GPUs, in id order; a start whose job or GPUs changed
       since the state was read is skipped, not half-applied; the others get their
       attempts and allocations in a fixed number of queries. The (gpu, slot)
       unique constraint is the last line of defence.
    2. After commit, each started attempt's ``job.launch`` goes to its node.
    3. ``Preempt`` decisions ask the victims' nodes to stop them.
    4. ``Wait`` decisions update the job's reason only when it changed.
    """
    result = ApplyResult()
    decisions = list(decisions)
    starts = [d for d in decisions if isinstance(d, policy.Start)]
    with transaction.atomic():
        t0 = time.perf_counter()
        result.started = start_jobs(starts)
        result.skipped = len(starts) - result.started
        result.starts_ms = _ms_since(t0)
        t0 = time.perf_counter()
        for decision in decisions:
            if isinstance(decision, policy.Preempt) and _preempt(decision):
                result.preempted += 1
        result.preempts_ms = _ms_since(t0)
        t0 = time.perf_counter()
        waits = [d for d in decisions if isinstance(d, policy.Wait)]
        if waits:
            result.updated_reasons = _update_reasons(waits)
        result.waits_ms = _ms_since(t0)
    return result


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _preempt(decision: policy.Preempt) -> bool:
    """Ask the victim's node to stop it (SIGTERM, its grace, SIGKILL); the job goes
    PREEMPTED -> PENDING when the agent reports the exit (``finish_attempt``), with
    its submit time, hence its age, kept. A victim already being stopped is left."""
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .filter(pk=decision.victim_id, status__in=Job.ON_NODE)
            .first()
        )
        if job is None or job.cancel_requested_at is not None:
            return False
        attempt = (
            Attempt.objects.select_for_update()
            .filter(job=job, ended_at__isnull=True)
            .first()
        )
        if attempt is None or attempt.kill_reason:
            return False
        attempt.kill_reason = "preempted"
        attempt.save(update_fields=["kill_reason"])
        _event(
            job,
            f"preempted for job #{decision.for_job_id}: {decision.reason}"[:500],
            source=JobEvent.Source.SCHEDULER,
        )
        _send_kill_on_commit(attempt, "preempted", job.kill_grace_s)
    return True


WAIT_FIELDS = (
    "pending_reason",
    "pending_message",
    "queue_position",
    "priority_breakdown",
    "est_start",
)


_UPDATE_WAITS = """
UPDATE scheduler_job AS j SET
    pending_reason = v.reason,
    pending_message = v.message,
    queue_position = v.position,
    priority_breakdown = v.breakdown::jsonb,
    est_start = v.est_start
FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::int[], %s::text[],
            %s::timestamptz[]) AS v(id, reason, message, position, breakdown, est_start)
WHERE j.id = v.id AND j.status = 'pending'
"""


def _update_reasons(waits: list[policy.Wait]) -> int:
    """Store each waiting job's reason, place, factors and planned start.

    Only rows that changed are written, in ONE statement (``UPDATE ... FROM
    unnest``): Django's ``bulk_update`` builds a CASE per field and row and took a
    minute for 10,000 jobs. Factors are rounded to 0.1 and planned starts to the
    second, so a job's growing age does not rewrite every row on every pass.
    """
    current = {
        row[0]: row[1:]
        for row in Job.objects.filter(
            pk__in=[w.job_id for w in waits], status=Job.Status.PENDING
        ).values_list("id", *WAIT_FIELDS)
    }
    rows: list[tuple[Any, ...]] = []
    for wait in waits:
        old = current.get(wait.job_id)
        if old is None:
            continue
        breakdown = {k: round(v, 1) for k, v in wait.breakdown.items()}
        est = _ts(round(wait.est_start)) if wait.est_start is not None else None
        new = (
            wait.reason.value,
            wait.message[:500],
            wait.position or None,
            breakdown,
            est,
        )
        if new != old:
            rows.append((wait.job_id, *new))
    if rows:
        columns = list(zip(*rows, strict=True))
        with connection.cursor() as cursor:
            cursor.execute(
                _UPDATE_WAITS,
                [
                    list(columns[0]),
                    list(columns[1]),
                    list(columns[2]),
                    list(columns[3]),
                    [json.dumps(b) for b in columns[4]],
                    list(columns[5]),
                ],
            )
    return len(rows)
