"""The scheduling pass's two ends around ``policy.decide``: ``cluster_state`` loads
what the policy needs in a fixed number of queries, ``apply_decisions`` applies its
Starts (``starts.py``), Preempts and Waits in one transaction.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from scheduler import classes, hooks, policy, queue_order
from scheduler.models import (
    Allocation,
    Attempt,
    Group,
    InterferencePair,
    Job,
    JobEvent,
    Membership,
    Node,
)
from scheduler.policy.predict import planned_runtime
from scheduler.services import interference
from scheduler.services.common import _event, _send_kill_on_commit, _ts
from scheduler.services.starts import start_jobs

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from agents import protocol


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


def decayed_usage(
    now: datetime, running: Mapping[tuple[str, str], float]
) -> policy.Usage:
    """Each group's and user's GPU-seconds: ended attempts' decayed with the
    fair-share half-life (``GPULAB_FAIRSHARE_HALF_LIFE``), plus ``running``, the
    running attempts' counted up to ``now`` by (group, user) (``snapshot`` has
    them at hand); and their shares. Three queries, whatever the history's size."""
    half_life = float(settings.GPULAB_FAIRSHARE_HALF_LIFE)
    horizon = now - timedelta(seconds=half_life * 10)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT g.name, u.username,
                   sum(r.gpu_seconds
                       * power(2.0, -extract(epoch from (%s - r.ended_at)) / %s))
            FROM scheduler_usagerecord r
            JOIN scheduler_group g ON g.id = r.group_id
            JOIN auth_user u ON u.id = r.user_id
            WHERE r.ended_at >= %s
            GROUP BY g.name, u.username
            """,
            [now, half_life, horizon],
        )
        rows = [*cursor.fetchall(), *((g, u, s) for (g, u), s in running.items())]
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


# The hot queries of a pass, in SQL: timestamps come back as epoch seconds (parsing
# 18,000 timestamps was a fifth of loading the state at 10,000 pending jobs), JSON as
# text (parsed once per distinct value), users and groups as ids (mapped through
# small dicts). No ORDER BY: PostgreSQL sorting 10,000 wide rows cost more than
# sorting the tuples here (into the models' default orders, so ``decide`` sees the
# order it saw from the ORM).
_GPUS_SQL = """
SELECT id, node_id, index, memory_total_mib, slots, present, mig_enabled, name,
       nvlink_peers::text, topology::text
FROM scheduler_gpu
"""
# Each pending job with what decide needs and, after it, its wait fields as stored
# (WAIT_FIELDS), so apply_decisions writes only what changed without reading 10,000
# rows a second time.
_PENDING_SQL = """
SELECT j.id, j.gpus, j.gpu_memory_mib, date_part('epoch', j.submitted_at), j.owner_id,
       j.group_id, j.priority_class, j.time_limit_s, j.predicted_runtime_s,
       j.shareable, j.gpu_model, j.workload, j.slowdown_cap, j.array_id,
       a.max_running, j.pending_reason, j.pending_message, j.queue_order,
       j.priority_breakdown::text, date_part('epoch', j.est_start)
FROM scheduler_job j LEFT JOIN scheduler_jobarray a ON a.id = j.array_id
WHERE j.status = 'pending'
"""
# The dependencies of every pending job with their jobs' state now (issue 8): one
# query for the pass, whatever the number of jobs.
_DEPENDENCIES_SQL = """
SELECT d.job_id, d.kind, d.depends_on_id, t.status, t.exit_code
FROM scheduler_job p
JOIN scheduler_jobdependency d ON d.job_id = p.id
JOIN scheduler_job t ON t.id = d.depends_on_id
WHERE p.status = 'pending'
"""
_RUNNING_SQL = """
SELECT t.id, t.job_id, t.number, date_part('epoch', t.started_at),
       date_part('epoch', t.created_at), t.kill_reason, j.owner_id, j.group_id,
       j.priority_class, j.time_limit_s, j.predicted_runtime_s,
       CASE WHEN j.last_preempted_at > %s THEN j.preemptions ELSE 0 END,
       j.shareable, j.workload, j.gpu_memory_mib, j.gpus, j.slowdown_cap, j.evictable,
       t.admission IS NOT NULL, coalesce((t.admission->>'trial')::boolean, false),
       t.peak_memory_mib, j.array_id
FROM scheduler_attempt t JOIN scheduler_job j ON j.id = t.job_id
WHERE t.ended_at IS NULL
"""

# A pending job's wait fields as stored: reason, message, queue position, priority
# breakdown (JSON text, parsed only when compared), planned start (epoch seconds).
StoredWait = tuple[str, str, int | None, str, float | None]


class Snapshot(NamedTuple):
    """What a pass reads: the policy's input, and the waiting jobs' stored reasons
    (``apply_decisions`` compares the new ones with them)."""

    cluster: policy.ClusterState
    stored_waits: dict[int, StoredWait]
    # Every quota in its current period (``cluster.quotas`` are their views); the
    # pass hands them back for their alerts (``hooks.quotas().pass_applied``).
    quotas: tuple[hooks.QuotaState, ...] = ()


def _cap(class_cap: float | None, own: float | None) -> float | None:
    """A job's slowdown cap: the tighter of its class's (None: unbounded) and the
    one its owner asked for."""
    if own is None:
        return class_cap
    return own if class_cap is None else min(class_cap, own)


def cluster_state(now: datetime | None = None) -> policy.ClusterState:
    """What ``policy.decide`` needs (see ``snapshot``)."""
    return snapshot(now).cluster


def snapshot(now: datetime | None = None) -> Snapshot:
    """Load what ``policy.decide`` needs in a fixed number of queries (never one
    per job): nodes, GPUs, live allocations, pending jobs (with their stored wait
    fields), running attempts, users' and groups' names, usage (the running
    attempts' by the charging rule: ``hooks.usage()``, one query), quotas (two
    queries: ``hooks.quotas()``)."""
    now = now or timezone.now()
    at = now.timestamp()
    specs = class_specs()
    # A node in maintenance takes no new jobs, like a draining one.
    nodes = [
        (pk, name, status, draining or maintenance)
        for pk, name, status, draining, maintenance in Node.objects.values_list(
            "pk", "name", "status", "draining", "maintenance"
        )
    ]
    users = dict(get_user_model().objects.values_list("pk", "username"))
    groups = dict(Group.objects.values_list("pk", "name"))
    used: dict[int, int] = {}
    gpus_of_attempt: dict[int, list[int]] = {}  # one entry per slot held
    for gpu_id, attempt_id in Allocation.objects.filter(
        released_at__isnull=True
    ).values_list("gpu_id", "attempt_id"):
        used[gpu_id] = used.get(gpu_id, 0) + 1
        gpus_of_attempt.setdefault(attempt_id, []).append(gpu_id)
    with connection.cursor() as cursor:
        cursor.execute(_GPUS_SQL)
        gpu_rows = cursor.fetchall()
        cursor.execute(_PENDING_SQL)
        pending_rows = cursor.fetchall()
        cursor.execute(_DEPENDENCIES_SQL)
        dependency_rows = cursor.fetchall()
        cursor.execute(_RUNNING_SQL, [now - timedelta(hours=1)])
        running_rows = cursor.fetchall()
    node_names = {pk: name for pk, name, _, _ in nodes}
    gpu_rows.sort(key=lambda row: (node_names.get(row[1], ""), row[2]))
    pending_rows.sort(key=itemgetter(0), reverse=True)
    running_rows.sort(key=itemgetter(1, 2))
    # Nodes of one kind share their GPUs' links: parse each distinct text once.
    peers_of: dict[str, tuple[int, ...]] = {}
    topology_of: dict[str, tuple[tuple[int, int], ...]] = {}
    gpus = []
    for pk, node_id, index, memory, slots, present, mig, name, peers, topo in gpu_rows:
        if peers not in peers_of:
            peers_of[peers] = tuple(int(p) for p in json.loads(peers))
        if topo not in topology_of:
            topology_of[topo] = tuple(
                (int(link["peer"]), int(link["level"])) for link in json.loads(topo)
            )
        gpus.append(
            policy.GpuView(
                id=pk,
                node_id=node_id,
                index=index,
                memory_total_mib=memory,
                slots=slots,
                free_slots=max(0, slots - used.get(pk, 0)),
                schedulable=present and not mig,
                model=name,
                nvlink_peers=peers_of[peers],
                topology=topology_of[topo],
            )
        )
    index_of = {row[0]: row[2] for row in gpu_rows}
    dependencies: dict[int, list[policy.Dependency]] = {}
    for job_id, kind, dep_id, dep_status, dep_exit in sorted(
        dependency_rows, key=itemgetter(0, 2)
    ):
        dependencies.setdefault(job_id, []).append(
            policy.Dependency(kind, dep_id, dep_status, dep_exit)
        )
    weights = {name: spec.weight for name, spec in specs.items()}
    caps = {name: spec.slowdown_cap for name, spec in specs.items()}
    pending = []
    stored_waits: dict[int, StoredWait] = {}
    for (
        pk,
        n_gpus,
        memory,
        submitted,
        owner_id,
        group_id,
        pclass,
        limit,
        predicted,
        shareable,
        model,
        workload,
        own_cap,
        array_id,
        array_limit,
        reason,
        message,
        order_key,
        breakdown,
        est_start,
    ) in pending_rows:
        pending.append(
            policy.PendingJob(
                id=pk,
                gpus=n_gpus,
                gpu_memory_mib=memory,
                priority_weight=weights.get(pclass, 0.0),
                submitted_at=submitted,
                user=users.get(owner_id, ""),
                group=groups.get(group_id, ""),
                priority_class=pclass,
                time_limit_s=float(limit),
                planned_s=float(planned_runtime(limit, predicted)),
                shareable=shareable and n_gpus == 1,
                gpu_model=model,
                workload=workload,
                slowdown_cap=_cap(caps.get(pclass, 1.5), own_cap),
                array_id=array_id,
                array_limit=array_limit,
                dependencies=tuple(dependencies.get(pk, ())),
            )
        )
        stored_waits[pk] = (reason, message, order_key, breakdown, est_start)
    # The running attempts' GPU time so far by the charging rule (one query),
    # for fair share here and the quotas' live usage below.
    live_usage = hooks.usage().running(now)
    charged = live_usage.seconds()
    running = []
    running_usage: dict[tuple[str, str], float] = {}
    for (
        attempt_id,
        job_id,
        _number,
        started,
        created,
        kill_reason,
        owner_id,
        group_id,
        pclass,
        limit,
        predicted,
        preemptions_last_hour,
        shareable,
        workload,
        declared_mib,
        n_gpus,
        own_cap,
        evictable,
        joined,
        trial,
        peak_mib,
        array_id,
    ) in running_rows:
        held = gpus_of_attempt.get(attempt_id)
        if not held:
            continue  # ended or released between the two reads
        user, group = users.get(owner_id, ""), groups.get(group_id, "")
        if attempt_id in charged:
            # Fair-share usage so far, by the rule its usage records will follow.
            seconds = charged[attempt_id]
            running_usage[group, user] = running_usage.get((group, user), 0) + seconds
        spec = specs.get(pclass)
        running.append(
            policy.RunningJob(
                id=job_id,
                gpu_ids=tuple(sorted(set(held), key=index_of.__getitem__)),
                started_at=started if started is not None else created,
                planned_s=float(planned_runtime(limit, predicted)),
                time_limit_s=float(limit),
                user=user,
                group=group,
                priority_class=pclass,
                # A job already being stopped is no candidate for preemption, and
                # its GPUs count as freeing now (no second set of victims).
                preemptible=bool(spec and spec.preemptible) and not kill_reason,
                stopping=bool(kill_reason),
                # Conservative: all its preemptions, if the last was within the hour.
                preemptions_last_hour=preemptions_last_hour,
                shareable=shareable and n_gpus == 1,
                workload=workload,
                gpu_memory_mib=declared_mib,
                peak_memory_mib=peak_mib,
                slowdown_cap=_cap(caps.get(pclass, 1.5), own_cap),
                joined_at=(started if started is not None else created)
                if joined
                else None,
                trial=trial,
                evictable=evictable,
                array_id=array_id,
            )
        )
    knowledge, trials = load_knowledge(
        now,
        {p.workload for p in pending if p.shareable}
        | {r.workload for r in running if r.shareable},
    )
    running = _with_measured_slowdowns(running, gpus_of_attempt, now)
    quotas = tuple(hooks.quotas().states(now, live_usage))
    cluster = policy.ClusterState(
        now=at,
        nodes=tuple(
            policy.NodeView(
                id=pk,
                name=name,
                schedulable=status == Node.Status.UP and not draining,
            )
            for pk, name, status, draining in nodes
        ),
        gpus=tuple(gpus),
        pending=tuple(pending),
        running=tuple(running),
        usage=decayed_usage(now, running_usage),
        classes=specs,
        config=policy_config(),
        knowledge=knowledge,
        trials_last_hour=trials,
        quotas=tuple(q.view() for q in quotas),
    )
    return Snapshot(cluster, stored_waits, quotas)


@dataclass
class ApplyResult:
    started: int = 0
    skipped: int = 0
    updated_reasons: int = 0
    preempted: int = 0
    evicted: int = 0
    quota_stopped: int = 0
    # Wall time of each part, for the pass's log line and bench/pass_scaling.py.
    starts_ms: float = 0.0
    preempts_ms: float = 0.0
    waits_ms: float = 0.0


def apply_decisions(
    decisions: Iterable[policy.Decision],
    stored_waits: Mapping[int, StoredWait] | None = None,
) -> ApplyResult:
    """Apply one pass's decisions in one transaction; ``stored_waits`` (from the
    pass's ``snapshot``) saves reading the waiting jobs' reasons again.

    1. The ``Start`` decisions together (``start_jobs``): lock the jobs (must still
       be PENDING) and their GPUs, in id order; a start whose job or GPUs changed
       since the state was read is skipped, not half-applied; the others get their
       attempts and allocations in a fixed number of queries. The (gpu, slot)
       unique constraint is the last line of defence.
    2. After commit, each started attempt's ``job.launch`` goes to its node.
    3. ``Preempt`` decisions ask the victims' nodes to stop them; ``Evict`` and
       ``QuotaStop`` too (``kill_reason`` "evicted", "quota").
    4. ``Wait`` decisions update the job's reason only when it changed.
    """
    result = ApplyResult()
    decisions = list(decisions)
    starts = [d for d in decisions if isinstance(d, policy.Start)]
    with transaction.atomic():
        t0 = time.perf_counter()
        result.started = start_jobs(starts, share_slots=policy_config().shares)
        result.skipped = len(starts) - result.started
        result.starts_ms = _ms_since(t0)
        t0 = time.perf_counter()
        for decision in decisions:
            if isinstance(decision, policy.Preempt) and _preempt(decision):
                result.preempted += 1
            elif isinstance(decision, policy.Evict) and _evict(decision):
                result.evicted += 1
            elif isinstance(decision, policy.QuotaStop) and _quota_stop(decision):
                result.quota_stopped += 1
        result.preempts_ms = _ms_since(t0)
        t0 = time.perf_counter()
        waits = [d for d in decisions if isinstance(d, policy.Wait)]
        if waits:
            result.updated_reasons = _update_reasons(waits, stored_waits)
        result.waits_ms = _ms_since(t0)
    return result


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _stop_for_scheduler(
    job_filter: Q, reason: protocol.KillReason, message: str
) -> tuple[Job, Attempt] | None:
    """Ask the node of a job on a node (matching ``job_filter``) to stop its live
    attempt for ``reason`` (SIGTERM, its grace, SIGKILL), with a job event; its exit
    then moves the job on (``finish_attempt``). A job being cancelled or already
    being stopped is left: None. Call inside a transaction."""
    job = (
        Job.objects.select_for_update()
        .filter(job_filter, status__in=Job.ON_NODE)
        .first()
    )
    if job is None or job.cancel_requested_at is not None:
        return None
    attempt = (
        Attempt.objects.select_for_update()
        .filter(job=job, ended_at__isnull=True)
        .first()
    )
    if attempt is None or attempt.kill_reason:
        return None
    attempt.kill_reason = reason
    attempt.save(update_fields=["kill_reason"])
    _event(job, message[:500], source=JobEvent.Source.SCHEDULER)
    _send_kill_on_commit(attempt, reason, job.kill_grace_s)
    return job, attempt


def _preempt(decision: policy.Preempt) -> bool:
    """Stop a preemption's victim; the job goes PREEMPTED -> PENDING when the
    agent reports the exit, with its submit time, hence its age, kept."""
    with transaction.atomic():
        return (
            _stop_for_scheduler(
                Q(pk=decision.victim_id),
                "preempted",
                f"preempted for job #{decision.for_job_id}: {decision.reason}",
            )
            is not None
        )


def _quota_stop(decision: policy.QuotaStop) -> bool:
    """Stop a running job whose hard quota is used up (``GPULAB_QUOTA_OVERRUN``
    is "stop"); its exit ends it CANCELLED (``finish_attempt``), not requeued."""
    with transaction.atomic():
        return (
            _stop_for_scheduler(Q(pk=decision.job_id), "quota", decision.reason)
            is not None
        )


def _evict(decision: policy.Evict) -> bool:
    """Stop the later job of a pair measured over a cap and requeue it (its age
    kept), if its owner allowed that (the policy checked ``evictable`` too); the
    pair is marked harmful in the same transaction, so the next pass never admits
    it again until an admin resets it."""
    with transaction.atomic():
        stopped = _stop_for_scheduler(
            Q(pk=decision.job_id, evictable=True), "evicted", decision.reason
        )
        if stopped is None:
            return False
        mark_harmful(*decision.pair, reason=decision.reason)
    return True


def mark_harmful(workload_a: str, workload_b: str, *, reason: str) -> None:
    """Both orders of the pair are refused from now on (an upsert per order)."""
    now = timezone.now()
    for a, b in ((workload_a, workload_b), (workload_b, workload_a)):
        InterferencePair.objects.update_or_create(
            workload_a=a,
            workload_b=b,
            defaults={
                "harmful": True,
                "harmful_reason": reason[:500],
                "updated_at": now,
            },
        )


def _with_measured_slowdowns(
    running: list[policy.RunningJob],
    gpus_of_attempt: Mapping[int, list[int]],
    now: datetime,
) -> list[policy.RunningJob]:
    """The running jobs, those on a shared GPU with their measured slowdown over
    the current sharing episode (``services.interference.measured``): a few
    queries, only when some GPU is shared."""
    on_gpu: dict[int, set[int]] = {}
    for attempt_id, gpu_ids in gpus_of_attempt.items():
        for g in gpu_ids:
            on_gpu.setdefault(g, set()).add(attempt_id)
    shared = {g: ids for g, ids in on_gpu.items() if len(ids) > 1}
    if not shared:
        return running
    attempts = Attempt.objects.select_related("job").in_bulk(
        [a for ids in shared.values() for a in ids]
    )
    live = [
        (g, attempts[a].job_id, attempts[a])
        for g, ids in shared.items()
        for a in sorted(ids)
        if a in attempts
    ]
    got = interference.measured(live, now)
    if not got:
        return running
    return [
        replace(r, measured_slowdown=got[r.id][0], measured_for_s=got[r.id][1])
        if r.id in got
        else r
        for r in running
    ]


def reset_interference_pairs(pks: Iterable[int], user_id: int | None) -> int:
    """Forget what was learned about these ordered pairs (observations and the
    harmful mark): the admission rule treats them as never seen again. Returns how
    many rows were reset."""
    return InterferencePair.objects.filter(pk__in=list(pks)).update(
        n=0,
        mean_log=0.0,
        m2=0.0,
        util_n=0,
        util_mean_log=0.0,
        util_m2=0.0,
        harmful=False,
        harmful_reason="",
        reset_at=timezone.now(),
        reset_by_id=user_id,
    )


def load_knowledge(
    now: datetime, workloads: Iterable[str] = ()
) -> tuple[policy.Knowledge, dict[frozenset[str], int]]:
    """What was learned about pairs (``InterferencePair``, one query), the solo busy
    fractions of ``workloads`` and of every workload in a learned pair (one
    query), and the exploration trials started in the last hour per unordered
    workload pair (the attempts whose admission was a trial, one query)."""
    pairs: dict[tuple[str, str], policy.Observations] = {}
    weak: dict[tuple[str, str], policy.Observations] = {}
    harmful: set[frozenset[str]] = set()
    for a, b, n, mean, m2, un, umean, um2, bad in InterferencePair.objects.values_list(
        "workload_a",
        "workload_b",
        "n",
        "mean_log",
        "m2",
        "util_n",
        "util_mean_log",
        "util_m2",
        "harmful",
    ):
        if n:
            pairs[a, b] = policy.Observations(n, mean, m2)
        if un:
            weak[a, b] = policy.Observations(un, umean, um2)
        if bad:
            harmful.add(frozenset((a, b)))
    busy = interference.solo_busies(
        {*workloads, *(w for pair in (*pairs, *weak) for w in pair)}
    )
    trials: dict[frozenset[str], int] = {}
    for record in Attempt.objects.filter(
        created_at__gte=now - timedelta(hours=1), admission__trial=True
    ).values_list("admission", flat=True):
        workloads = (record or {}).get("workloads") or []
        for other in workloads[1:]:
            key = frozenset((workloads[0], other))
            trials[key] = trials.get(key, 0) + 1
    return (
        policy.Knowledge(pairs=pairs, busy=busy, weak=weak, harmful=frozenset(harmful)),
        trials,
    )


WAIT_FIELDS = (
    "pending_reason",
    "pending_message",
    "queue_order",
    "priority_breakdown",
    "est_start",
)


# Rows another transaction holds (a job being started, cancelled or moved by a
# concurrent pass) are skipped, not waited for: their reason is moot or stale
# anyway, and an UPDATE that waits on rows in no set order can deadlock with a pass
# that locks jobs in id order (two passes raced in tests/scheduler/test_concurrency).
_UPDATE_WAITS = """
WITH v AS (
    SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::bigint[], %s::text[],
                         %s::timestamptz[])
        AS v(id, reason, message, order_key, breakdown, est_start)
), mine AS (
    SELECT j.id FROM scheduler_job AS j JOIN v ON v.id = j.id
    WHERE j.status = 'pending'
    FOR UPDATE OF j SKIP LOCKED
)
UPDATE scheduler_job AS j SET
    pending_reason = v.reason,
    pending_message = v.message,
    queue_order = v.order_key,
    priority_breakdown = v.breakdown::jsonb,
    est_start = v.est_start
FROM v JOIN mine ON mine.id = v.id
WHERE j.id = v.id
"""

_STORED_WAITS = """
SELECT id, pending_reason, pending_message, queue_order, priority_breakdown::text,
       extract(epoch FROM est_start)::float8
FROM scheduler_job WHERE status = 'pending' AND id = ANY(%s)
"""


def _update_reasons(
    waits: list[policy.Wait], stored: Mapping[int, StoredWait] | None = None
) -> int:
    """Store each waiting job's reason, order key, factors and planned start.

    Only rows that changed are written, in ONE statement (``UPDATE ... FROM
    unnest``): Django's ``bulk_update`` builds a CASE per field and row and took a
    minute for 10,000 jobs. Factors are rounded to whole points (as the pages
    show them: at 0.1, the fair share moving with the running jobs' usage
    rewrote a fifth of the waiting rows on every pass of a burst) and planned
    starts to the second, so a job's growing age does not rewrite every row on
    every pass; the
    order keys (``scheduler.queue_order``) change only where the order did, so a
    start does not rewrite the place of every job behind it (it did: 95 % of the
    waiting rows were written on each pass of a burst, bench/submit_burst.py).
    The stored values come from the pass's snapshot (or one query without it); a
    job no longer pending is left (the UPDATE checks too).
    """
    if stored is None:
        with connection.cursor() as cursor:
            cursor.execute(_STORED_WAITS, [[w.job_id for w in waits]])
            stored = {row[0]: row[1:] for row in cursor.fetchall()}
    placed = sorted((w for w in waits if w.position), key=attrgetter("position"))
    keys = queue_order.assign(
        [w.job_id for w in placed], {pk: old[2] for pk, old in stored.items()}
    )
    rows: list[tuple[Any, ...]] = []
    for wait in waits:
        old = stored.get(wait.job_id)
        if old is None:
            continue
        breakdown = {k: float(round(v)) for k, v in wait.breakdown.items()}
        est = round(wait.est_start) if wait.est_start is not None else None
        key = keys.get(wait.job_id, old[2]) if wait.position else None
        new = (wait.reason.value, wait.message[:500], key)
        # The scalars first: the stored breakdown is parsed only when they match.
        if new == old[:3] and est == old[4] and breakdown == json.loads(old[3]):
            continue
        rows.append((wait.job_id, *new, breakdown, None if est is None else _ts(est)))
    if not rows:
        return 0
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
        return int(cursor.rowcount)
