"""The scheduling pass's first end: ``snapshot`` loads what the policy needs
(``policy.ClusterState``) and what the waiting jobs have stored, in a fixed number of
queries whatever the size of the queue; ``load_knowledge`` what co-location has
learned.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from scheduler import classes, hooks, policy
from scheduler.models import (
    Allocation,
    Attempt,
    Group,
    InterferencePair,
    Membership,
    Node,
)
from scheduler.policy.predict import planned_runtime
from scheduler.policy.remaining import from_reports
from scheduler.services import interference

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping


def policy_config() -> policy.PolicyConfig:
    return policy.PolicyConfig(
        **settings.GPULAB_POLICY,
        las_preemption=settings.GPULAB_LAS_PREEMPTION,
        preempt_min_run_s=settings.GPULAB_PREEMPT_MIN_RUN,
        las_threshold_gpu_s=settings.GPULAB_LAS_THRESHOLD * 3600.0,
        las_max_slowdown=settings.GPULAB_LAS_MAX_SLOWDOWN,
        max_wait_s=settings.GPULAB_MAX_WAIT,
        preempted_max_wait_s=settings.GPULAB_PREEMPTED_MAX_WAIT,
        las_extra_plans=settings.GPULAB_LAS_EXTRA_PLANS,
        las_victims=settings.GPULAB_LAS_VICTIMS,
        las_shorter=settings.GPULAB_LAS_SHORTER,
        guest_backfill=settings.GPULAB_GUEST_BACKFILL,
    )


def class_specs() -> dict[str, policy.ClassSpec]:
    return {
        name: policy.ClassSpec(
            name=name,
            weight=c.weight,
            preemptible=c.preemptible,
            slowdown_cap=c.slowdown_cap,
            interactive=c.interactive,
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
# 18,000 timestamps is a fifth of loading the state at 10,000 pending jobs), JSON as
# text (parsed once per distinct value), users and groups as ids (mapped through
# small dicts). No ORDER BY: PostgreSQL sorting 10,000 wide rows costs more than
# sorting the tuples here (into the models' default orders, so ``decide`` sees the
# order the ORM would give).
_GPUS_SQL = """
SELECT id, node_id, index, memory_total_mib, slots, present, mig_enabled, name,
       nvlink_peers::text, topology::text
FROM scheduler_gpu
"""
# A job's attained service before its current attempt (LAS preemption,
# ``policy.preempt``): GPUs x seconds its ended attempts ran. One indexed look-up
# per row, not a scan of every attempt in the history.
_PRIOR_SQL = """(SELECT coalesce(sum(date_part('epoch', e.ended_at - e.started_at)), 0)
        FROM scheduler_attempt e
        WHERE e.job_id = j.id AND e.started_at IS NOT NULL
              AND e.ended_at IS NOT NULL) * j.gpus"""
# A job's preemptions in the hour before the pass (``preempt_max_per_hour``): its
# attempts stopped by a preemption that ended after the cutoff (%s). Looked up only
# for a job whose last preemption is that recent, so a queue that was never
# preempted pays one comparison a row.
_RECENT_PREEMPTIONS_SQL = """CASE WHEN j.last_preempted_at > %s THEN
       (SELECT count(*) FROM scheduler_attempt e
        WHERE e.job_id = j.id AND e.kill_reason = 'preempted' AND e.ended_at > %s)
       ELSE 0 END"""
# Each pending job with what decide needs and, after it, its wait fields as stored
# (WAIT_FIELDS), so apply_decisions writes only what changed without reading 10,000
# rows a second time.
_PENDING_SQL = f"""
SELECT j.id, j.gpus, j.gpu_memory_mib, date_part('epoch', j.submitted_at), j.owner_id,
       j.group_id, j.priority_class, j.time_limit_s, j.predicted_runtime_s,
       j.shareable, j.gpu_model, j.workload, j.slowdown_cap, j.array_id,
       a.max_running, j.checkpointable, {_PRIOR_SQL},
       date_part('epoch', j.last_preempted_at), {_RECENT_PREEMPTIONS_SQL},
       j.pending_reason, j.pending_message, j.queue_order,
       j.priority_breakdown::text, date_part('epoch', j.est_start)
FROM scheduler_job j LEFT JOIN scheduler_jobarray a ON a.id = j.array_id
WHERE j.status = 'pending'
"""
# The dependencies of every pending job with their jobs' state now: one
# query for the pass, whatever the number of jobs.
_DEPENDENCIES_SQL = """
SELECT d.job_id, d.kind, d.depends_on_id, t.status, t.exit_code
FROM scheduler_job p
JOIN scheduler_jobdependency d ON d.job_id = p.id
JOIN scheduler_job t ON t.id = d.depends_on_id
WHERE p.status = 'pending'
"""
_RUNNING_SQL = f"""
SELECT t.id, t.job_id, t.number, date_part('epoch', t.started_at),
       date_part('epoch', t.created_at), t.kill_reason, j.owner_id, j.group_id,
       j.priority_class, j.time_limit_s, j.predicted_runtime_s,
       {_RECENT_PREEMPTIONS_SQL},
       j.shareable, j.workload, j.gpu_memory_mib, j.gpus, j.slowdown_cap, j.evictable,
       t.admission IS NOT NULL, coalesce((t.admission->>'trial')::boolean, false),
       t.peak_memory_mib, j.array_id, j.checkpointable, {_PRIOR_SQL},
       date_part('epoch', t.checkpoint_at), date_part('epoch', j.submitted_at),
       t.guest, date_part('epoch', j.last_preempted_at),
       t.progress_step, t.progress_total, date_part('epoch', t.progress_at),
       t.progress_first_step, date_part('epoch', t.progress_first_at)
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
        hour_ago = now - timedelta(hours=1)
        cursor.execute(_PENDING_SQL, [hour_ago, hour_ago])
        pending_rows = cursor.fetchall()
        cursor.execute(_DEPENDENCIES_SQL)
        dependency_rows = cursor.fetchall()
        cursor.execute(_RUNNING_SQL, [hour_ago, hour_ago])
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
        checkpointable,
        attained,
        preempted_at,
        preempted_last_hour,
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
                attained_gpu_s=float(attained),
                checkpointable=checkpointable,
                preempted_at=preempted_at,
                preemptions_last_hour=preempted_last_hour,
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
        checkpointable,
        prior,
        checkpoint_at,
        submitted_at,
        guest,
        preempted_at,
        *reports,
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
                progress=from_reports(*reports),
                checkpointable=checkpointable,
                prior_gpu_s=float(prior),
                submitted_at=submitted_at,
                checkpoint_at=checkpoint_at,
                guest=guest,
                preempted_at=preempted_at,
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
