"""What node agents report: authentication, hello (facts and reconciliation),
heartbeats, metrics, job starts and exits (one rank at a time for jobs spanning
nodes), log chunks, progress reports, and the stored output read back.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, cast, get_args

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Func, IntegerField, Q, Sum
from django.utils import timezone

from agents import protocol
from scheduler import hooks
from scheduler import metrics as metrics_store
from scheduler.models import (
    Allocation,
    Attempt,
    Gpu,
    Job,
    JobEvent,
    JobLogChunk,
    Node,
    ProgressSample,
    hash_token,
)
from scheduler.services import interference, late_reports
from scheduler.services.common import (
    _after_commit_state_change,
    _event,
    _pass_after_commit,
    _record_transition,
    _send_kill_on_commit,
    _ts,
    kill_frame,
)
from scheduler.services.starts import launch_frame

if TYPE_CHECKING:
    from collections.abc import Iterable

log = logging.getLogger(__name__)

# A progress report read this far ahead of the portal's clock is refused: it would
# hide every later report (older than it) from the attempt.
PROGRESS_AHEAD_S = 3600.0


class FrameRefused(Exception):
    """A valid frame this node may not send (e.g. about another node's job); the
    consumer answers with an ``error`` frame saying ``str()``, and acks it."""


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
       an attempt the agent runs that the portal has ended (or never made) is killed
       as stale, so a job never runs twice.
    """
    commands: list[dict[str, Any]] = []
    rejected: list[str] = []
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        now = timezone.now()
        was_lost = node.status == Node.Status.LOST
        node.status = Node.Status.UP
        node.connected = True
        node.last_seen_at = now
        node.hostname = hello.hostname[:255]
        node.driver_version = (hello.driver_version or "")[:64]
        node.cuda_version = (hello.cuda_version or "")[:64]
        node.agent_version = hello.agent_version[:64]
        node.incarnation = hello.incarnation
        node.save()
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
        for attempt in live:
            if attempt.pk in running or str(node.pk) in attempt.rank_exits:
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
                            _kill_reason(attempt.kill_reason),
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


def _kill_reason(value: str) -> protocol.KillReason:
    """An attempt's stored ``kill_reason`` as the protocol's (``stale`` if unknown)."""
    if value in get_args(protocol.KillReason):
        return cast("protocol.KillReason", value)
    return "stale"


def rank_launch(attempt: Attempt, node_id: int) -> dict[str, Any]:
    """The ``job.launch`` of the attempt's rank on ``node_id``: its GPUs there (and,
    for a job spanning nodes, that rank's variables)."""
    gpus = [
        a.gpu
        for a in attempt.allocations.select_related("gpu").filter(gpu__node_id=node_id)
    ]
    unique = list({g.pk: g for g in gpus}.values())
    return launch_frame(attempt.job, attempt, unique)


# Each rank's start (of a job spanning nodes) and each re-sent launch is also a job
# event: the job's timeline for its owner. Nothing reads them back; the state is
# ``Attempt.rank_starts`` / ``launch_resends`` / ``launch_resent_at``.
def rank_started_message(attempt: Attempt, rank: int, node: str, pid: int) -> str:
    return f"attempt {attempt.number} rank {rank}: running on {node} (pid {pid})"


def launch_resent_message(attempt: Attempt, rank: int, node: str, detail: str) -> str:
    who = f"attempt {attempt.number}"
    if len(attempt.node_ids) > 1:
        who += f" rank {rank}"
    return f"{who}: launch re-sent to {node} ({detail})"


def relaunch_or_fail(job: Job, what: str) -> str:
    """The job (locked; an attempt of it just ended ``Attempt.UNLAUNCHED``) goes
    back to PENDING, with its age kept, or FAILED once more than
    ``GPULAB_RELAUNCH_MAX`` of its attempts ended so. Sets ``job.status``; returns
    the event's message."""
    count = Attempt.objects.filter(job=job, outcome__in=Attempt.UNLAUNCHED).count()
    limit = settings.GPULAB_RELAUNCH_MAX
    if count <= limit:
        job.status = Job.Status.PENDING
        return f"{what}; relaunching (relaunch {count} of at most {limit})"
    job.status = Job.Status.FAILED
    return f"{what}; not relaunched: {count} attempts could not launch"


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


def record_metrics(
    node_id: int, metrics: protocol.MetricsData, *, persist: bool = False
) -> int:
    """Take one metrics frame of a node: ``record_metrics_many`` of that frame.
    Returns the GPUs whose latest state it became."""
    return record_metrics_many([MetricsFrame(node_id, metrics, persist)])


class MetricsFrame(NamedTuple):
    node_id: int
    metrics: protocol.MetricsData
    # Store it in the history too (it starts a persistence interval).
    persist: bool = False


# Each GPU's latest state, where the frame is not older than what is stored (a
# replayed sample never overwrites the present, even one written meanwhile by
# another web process).
# The batch is one JSON document (arrays, one per column, cost the web process
# seven times the CPU to quote, scheduler/metrics.py ``_INSERT``).
_LATEST_SQL = """
UPDATE scheduler_gpu g SET latest = v.latest, latest_at = v.at
FROM jsonb_to_recordset(%s::jsonb) AS v(id bigint, latest jsonb, at timestamptz)
WHERE g.id = v.id AND (g.latest_at IS NULL OR g.latest_at <= v.at)
"""
# What a batch reads of its nodes' GPUs (not ``latest``: a batch only writes it,
# and decoding every GPU's stored JSON cost as much as the frames' own).
_GPU_FIELDS = ("id", "node_id", "index", "uuid", "present", "latest_at")


def record_metrics_many(frames: list[MetricsFrame]) -> int:
    """Take metrics frames of any nodes in one transaction and a fixed number of
    statements (the web process's ``scheduler.ingest.MetricsWriter`` batches what
    its connections received meanwhile).

    1. Keep each as the latest state of its GPUs (unless a newer one is stored: a
       replayed sample never overwrites the present; of two frames of a GPU in the
       batch the newer wins).
    2. A GPU reported lost (fell off the bus) stops being schedulable: the node's
       capacity shrinks until a hello reports it again.
    3. The ``persist`` ones are stored in the history (``scheduler.metrics``; a
       replay of a stored sample is ignored there), and raise their attempts' peak
       memory.
    4. On GPUs whose frame shows processes of two attempts or more, a job over its
       declared memory is stopped (``stop_memory_overruns``).
    Samples of GPUs the node does not have (wrong index or uuid) are ignored.
    A persisted frame's per-process attempt ids are first checked
    (``_own_processes``): a node cannot charge memory or activity to an attempt
    that never held that GPU. (Between persists, ``Gpu.latest`` keeps the frame as
    sent: its readers look processes up by the GPU's own allocations.)
    Returns the GPUs whose latest state a frame became.
    """
    if not frames:
        return 0
    nodes = sorted({f.node_id for f in frames})
    by_node: dict[int, dict[int, Gpu]] = {}
    for row in Gpu.objects.filter(node_id__in=nodes).only(*_GPU_FIELDS):
        by_node.setdefault(row.node_id, {})[row.index] = row
    # Oldest first, so that the newest of a GPU's frames is its latest.
    ordered = sorted(frames, key=lambda f: f.metrics.sampled_at)
    newest: dict[int, Gpu] = {}
    lost: set[int] = set()
    persisted: list[tuple[dict[int, int], protocol.MetricsData]] = []
    # the persisted samples (their attempt ids checked), for the peaks
    peak_samples: list[dict[str, Any]] = []
    changed = 0
    for frame in ordered:
        gpus = by_node.get(frame.node_id, {})
        metrics = frame.metrics
        if frame.persist:
            metrics = _own_processes(frame.node_id, metrics, gpus)
        at = _ts(metrics.sampled_at)
        known: dict[int, int] = {}
        for sample in metrics.gpus:
            gpu = gpus.get(sample.index)
            if gpu is None or gpu.uuid != sample.uuid:
                continue
            known[sample.index] = gpu.pk
            if sample.lost and gpu.present:
                lost.add(gpu.pk)
            if gpu.latest_at is None or at >= gpu.latest_at:
                gpu.latest = sample.model_dump(mode="json")
                gpu.latest_at = at
                newest[gpu.pk] = gpu
                changed += 1
                if frame.persist:
                    peak_samples.append(gpu.latest)
        if frame.persist and known:
            persisted.append((known, metrics))
    with transaction.atomic():
        if newest:
            with connection.cursor() as cursor:
                cursor.execute(
                    _LATEST_SQL,
                    [
                        json.dumps(
                            [
                                {"id": pk, "latest": g.latest, "at": g.latest_at}
                                for pk, g in newest.items()
                            ],
                            default=datetime.isoformat,
                        )
                    ],
                )
        if lost:
            Gpu.objects.filter(pk__in=sorted(lost)).update(present=False)
            log.error("GPU(s) %s lost (fell off the bus)", sorted(lost))
        Node.objects.filter(pk__in=nodes).update(last_seen_at=timezone.now())
        if persisted:
            metrics_store.store_samples_many(persisted)
            record_peak_memory(peak_samples)
    # only GPUs whose sample shows processes of two attempts or more: a query
    # only where jobs share
    shared = [g for g in newest.values() if len(_attempts_in(g.latest)) > 1]
    if shared:
        stop_memory_overruns(shared)
    return changed


def _own_processes(
    node_id: int, metrics: protocol.MetricsData, gpus: dict[int, Gpu]
) -> protocol.MetricsData:
    """The frame with every process's ``attempt_id`` that never had an allocation
    on that GPU made None (a foreign process), in one query, only when the frame
    names attempts. An attempt that ended keeps its processes: a replayed sample
    may predate the end."""
    claimed = {
        (s.index, p.attempt_id)
        for s in metrics.gpus
        for p in s.processes
        if p.attempt_id is not None
    }
    if not claimed:
        return metrics
    by_pk = {g.pk: g.index for g in gpus.values()}
    allowed = {
        (by_pk[gpu_id], attempt_id)
        for gpu_id, attempt_id in Allocation.objects.filter(
            gpu_id__in=list(by_pk), attempt_id__in={a for _, a in claimed}
        ).values_list("gpu_id", "attempt_id")
    }
    if claimed <= allowed:
        return metrics
    log.warning(
        "node %d: metrics name attempts on GPUs they never held"
        " ((GPU index, attempt) %s); their processes are kept as foreign",
        node_id,
        sorted(claimed - allowed),
    )
    samples = [
        s.model_copy(
            update={
                "processes": [
                    p
                    if p.attempt_id is None or (s.index, p.attempt_id) in allowed
                    else p.model_copy(update={"attempt_id": None})
                    for p in s.processes
                ]
            }
        )
        for s in metrics.gpus
    ]
    return metrics.model_copy(update={"gpus": samples})


# Raise each live attempt's peak to what it holds now, where that is more: one
# statement for the whole frame, which writes only the rows that grew.
_PEAKS_SQL = """
UPDATE scheduler_attempt t SET peak_memory_mib = v.mib
FROM unnest(%s::bigint[], %s::int[]) AS v(id, mib)
WHERE t.id = v.id AND t.ended_at IS NULL
  AND (t.peak_memory_mib IS NULL OR t.peak_memory_mib < v.mib)
"""


def record_peak_memory(samples: Iterable[dict[str, Any]]) -> int:
    """Keep the most memory each attempt's processes held on one GPU
    (``Attempt.peak_memory_mib``: the memory rule of co-location reads it beside
    the declaration) from these samples (one GPU's each, as ``Gpu.latest``).
    Called on the persisted frames, so a peak is seen at that cadence. Returns
    the rows raised."""
    peaks: dict[int, int] = {}
    for sample in samples:
        held: dict[int, int] = {}
        for proc in sample.get("processes") or ():
            aid, mib = proc.get("attempt_id"), proc.get("used_memory_mib")
            if aid is not None and mib is not None:
                held[int(aid)] = held.get(int(aid), 0) + int(mib)
        for aid, mib in held.items():
            peaks[aid] = max(peaks.get(aid, 0), mib)
    if not peaks:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(_PEAKS_SQL, [list(peaks), list(peaks.values())])
        return int(cursor.rowcount)


def _attempts_in(sample: dict[str, Any]) -> set[int]:
    return {
        int(p["attempt_id"])
        for p in sample.get("processes") or ()
        if p.get("attempt_id") is not None
    }


def stop_memory_overruns(gpus: list[Gpu]) -> int:
    """On a shared GPU, a job whose processes hold more memory than it declared
    (plus ``colo_headroom_mib``) is the one stopped (``memory_overrun``), never its
    partner: P1 reserves each job only what it declared, and the partner was
    admitted on that promise (a job without a declaration never shares). Returns
    how many were stopped: one query for the GPUs' live attempts, then one
    transaction per job stopped (a job already being stopped is left)."""
    if not gpus:
        return 0
    live: dict[int, list[tuple[int, int, int | None]]] = {}
    for gpu_id, attempt_id, job_id, declared in Allocation.objects.filter(
        gpu_id__in=[g.pk for g in gpus], released_at__isnull=True
    ).values_list(
        "gpu_id", "attempt_id", "attempt__job_id", "attempt__job__gpu_memory_mib"
    ):
        live.setdefault(gpu_id, []).append((attempt_id, job_id, declared))
    headroom = int(settings.GPULAB_POLICY.get("colo_headroom_mib", 0))
    stopped = 0
    for gpu in gpus:
        holders = {a: (j, d) for a, j, d in live.get(gpu.pk, [])}
        if len(holders) < 2:
            continue  # alone on its GPU: its memory is its own business
        used: dict[int, int] = {}
        for proc in gpu.latest.get("processes") or ():
            aid = proc.get("attempt_id")
            if aid in holders:
                used[aid] = used.get(aid, 0) + int(proc.get("used_memory_mib") or 0)
        for attempt_id, mib in used.items():
            job_id, declared = holders[attempt_id]
            if declared is None or mib <= declared + headroom:
                continue
            with transaction.atomic():
                attempt = (
                    Attempt.objects.select_for_update()
                    .filter(pk=attempt_id, ended_at__isnull=True, kill_reason="")
                    .select_related("job")
                    .first()
                )
                if attempt is None:
                    continue
                attempt.kill_reason = "memory_overrun"
                attempt.save(update_fields=["kill_reason"])
                _event(
                    attempt.job,
                    f"stopped: it holds {mib} MiB on shared GPU {gpu.index} of its"
                    f" node, over the {declared} MiB it declared (+{headroom} MiB"
                    " headroom); its partner keeps running",
                    source=JobEvent.Source.SCHEDULER,
                )
                _send_kill_on_commit(
                    attempt, "memory_overrun", attempt.job.kill_grace_s
                )
                stopped += 1
    return stopped


def _attempt_of_node(node_id: int, attempt_id: int, job_id: int) -> Attempt | None:
    """The attempt, locked, if this node runs it (rank 0 or another rank) for this
    job: a node cannot report for another node's jobs."""
    attempt = (
        Attempt.objects.select_for_update().filter(pk=attempt_id, job_id=job_id).first()
    )
    if attempt is None or node_id not in attempt.node_ids:
        log.warning(
            "node %d reported attempt %d of job %d, which %s; ignored",
            node_id,
            attempt_id,
            job_id,
            "does not exist" if attempt is None else "is not allocated to it",
        )
        return None
    return attempt


def mark_started(node_id: int, data: protocol.JobStartedData) -> bool:
    """The agent started the attempt (a rank of it, for a job spanning nodes).

    1. Lock the attempt (it must belong to this node and job, and be live); a rank
       already in ``rank_starts`` is a replay: nothing changes.
    2. Record the rank's start in ``rank_starts`` (what ``liveness.resend_launches``
       reads); the first rank's is also the attempt's ``started_at`` / ``pid`` and
       moves the job STARTING -> RUNNING.
    3. A job event says so (the timeline; never read back).
    """
    with transaction.atomic():
        attempt = _attempt_of_node(node_id, data.attempt_id, data.job_id)
        if attempt is None:
            return False
        if attempt.ended_at is not None:
            # Ended by the portal (lost node) before this start came: recorded
            # for its charge, the job left where it is.
            return late_reports.corrects(attempt) and late_reports.late_start(
                attempt, node_id, data
            )
        if attempt.rank_started(node_id):
            return False  # a replay of this rank's start
        spans = len(attempt.node_ids) > 1
        rank = attempt.node_ids.index(node_id)
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        started = _ts(data.started_at)
        old = job.status
        first = attempt.started_at is None
        attempt.rank_starts = {
            **attempt.rank_starts,
            str(node_id): {"started_at": data.started_at, "pid": data.pid},
        }
        if first:
            attempt.started_at = started
            attempt.pid = data.pid
        attempt.save(update_fields=["rank_starts", "started_at", "pid"])
        if first:
            hooks.accounting().attempt_started(attempt)
            if job.status == Job.Status.STARTING:
                job.status = Job.Status.RUNNING
            if job.started_at is None:
                job.started_at = started
            job.save(update_fields=["status", "started_at"])
        name = Node.objects.values_list("name", flat=True).get(pk=node_id)
        _event(
            job,
            rank_started_message(attempt, rank, name, data.pid)
            if spans
            else f"running on {name} (pid {data.pid})",
            source=JobEvent.Source.AGENT,
            from_status=old if first else "",
            to_status=job.status if first else "",
            at=started,
        )
        if first:
            _after_commit_state_change(job, "running")
            if job.status == Job.Status.RUNNING:
                hooks.notifier().job_started(job, f"running on {name}")
    return True


def _end_attempt(
    attempt: Attempt, ended: datetime, outcome: str, exit_code: int | None
) -> None:
    """End a live attempt: release its slots and charge its GPU time
    (``hooks.accounting().attempt_ended``: agent-reported start to ``ended``)."""
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


def finish_attempt(node_id: int, data: protocol.JobExitedData) -> bool:
    """The agent reports an attempt's end. Idempotent: a duplicate is ignored.

    0. An attempt the portal already ended without the agent (its node was
       lost) gets its end and charge corrected, nothing else
       (``late_reports.late_exit``).
    1. Lock the attempt (it must belong to this node and job) and the job.
    2. End the attempt: release its GPU slots, record usage from agent times.
    3. Move the job: CANCELLED if a cancel was asked; COMPLETED on exit 0; FAILED on
       a non-zero exit or a launch failure; back to PENDING (or FAILED when the job
       does not requeue) when its process was lost without an exit code.
    4. After commit: broadcast, and run a scheduling pass for the freed GPUs.
    """
    with transaction.atomic():
        attempt = _attempt_of_node(node_id, data.attempt_id, data.job_id)
        if attempt is None:
            return False
        if attempt.ended_at is not None:
            # Ended by the portal (lost node, given-up launch): the agent's exit
            # corrects its end and charge; the job was requeued or failed once.
            return late_reports.corrects(attempt) and late_reports.late_exit(
                attempt, node_id, data
            )
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        if len(attempt.node_ids) > 1:
            if str(node_id) in attempt.rank_exits:
                return False  # a replayed rank exit
            whole = _rank_exited(attempt, job, node_id, data)
            if whole is None:
                return True  # other ranks still run
            data = whole
        ended = _ts(data.ended_at)
        if attempt.started_at is not None and ended < attempt.started_at:
            ended = attempt.started_at
        _end_attempt(attempt, ended, data.reason, data.exit_code)
        old = job.status
        if job.status not in Job.ON_NODE:
            # The job already moved on (e.g. requeued when its node was lost).
            _event(
                job,
                f"late exit of attempt {attempt.number} ignored ({data.reason})",
                source=JobEvent.Source.AGENT,
            )
            return True
        code = data.exit_code
        server_kill = attempt.kill_reason
        if job.cancel_requested_at is not None:
            job.status = Job.Status.CANCELLED
            message = "cancelled; process stopped"
        elif server_kill == "preempted":
            _event(
                job,
                f"preempted; process stopped (exit code {code})",
                source=JobEvent.Source.AGENT,
                from_status=old,
                to_status=Job.Status.PREEMPTED,
                at=ended,
            )
            old = Job.Status.PREEMPTED
            job.status = Job.Status.PENDING
            job.preemptions += 1
            job.last_preempted_at = ended
            job.save(update_fields=["preemptions", "last_preempted_at"])
            message = "requeued after preemption (its age is kept)"
        elif server_kill == "evicted":
            job.status = Job.Status.PENDING
            message = (
                "sent back to the queue (its age is kept): a job sharing its GPU ran"
                f" over its slowdown cap (exit code {code})"
            )
        elif server_kill == "quota":
            # Stopped by the scheduler: a hard quota of it was used up and
            # GPULAB_QUOTA_OVERRUN is "stop". Not requeued (it would wait anyway).
            # The scheduler's event before this one names the quota and its use.
            job.status = Job.Status.CANCELLED
            message = (
                "stopped by the scheduler: a hard quota of it is used up"
                f" (GPULAB_QUOTA_OVERRUN=stop), exit code {code}"
            )
        elif server_kill == "requeued":
            job.status = Job.Status.PENDING
            message = (
                "sent back to the queue by an admin (its age is kept;"
                f" exit code {code})"
            )
        elif server_kill == "memory_overrun":
            job.status = Job.Status.FAILED
            message = (
                "stopped: it used more GPU memory than it declared on a shared GPU"
                f" (exit code {code})"
            )
        elif data.reason == "port_busy":
            # Nothing ran: relaunch as a new attempt (a new rendezvous port).
            message = relaunch_or_fail(
                job, f"{data.message} on node {_port_busy_node(attempt, node_id)}"
            )
        elif data.reason == "timeout" or server_kill == "timeout":
            job.status = Job.Status.TIMEOUT
            limit = timedelta(seconds=job.time_limit_s)
            message = f"stopped at its time limit ({limit})"
        elif server_kill == "peer_failed" and data.reason in ("exited", "killed"):
            job.status = Job.Status.FAILED
            message = f"a rank failed with exit code {code}; the others were stopped"
        elif data.reason == "exited" and code == 0:
            job.status = Job.Status.COMPLETED
            message = "completed (exit code 0)"
        elif data.reason == "exited":
            # The user's program failed: a user error, not a system one.
            job.status = Job.Status.FAILED
            message = f"failed with exit code {code}"
        elif data.reason == "killed" and server_kill:
            job.status = Job.Status.FAILED
            message = f"stopped ({server_kill}), exit code {code}"
        elif data.reason == "launch_failed":
            job.status = Job.Status.FAILED
            message = f"could not be started: {data.message or 'launch failed'}"
        else:
            # lost / never_started / killed by the agent on its own (cut off from
            # the portal): a node problem, not the user's. Requeue per the job.
            what = data.message or f"process {data.reason}"
            if job.requeue_on_node_loss:
                job.status = Job.Status.PENDING
                message = f"requeued: {what} on {attempt.node.name}"
            else:
                job.status = Job.Status.FAILED
                message = f"failed: {what} on {attempt.node.name}"
        _record_transition(
            job,
            old,
            message,
            source=JobEvent.Source.AGENT,
            at=ended,
            exit_code=code,
            with_exit_code=True,
        )
        _pass_after_commit()
    return True


def _port_busy_node(attempt: Attempt, node_id: int) -> str:
    """Name of the node that reported the attempt's rendezvous port busy."""
    busy = [
        int(key)
        for key, rank_exit in attempt.rank_exits.items()
        if rank_exit.get("reason") == "port_busy"
    ]
    pk = busy[0] if busy else node_id
    return str(Node.objects.values_list("name", flat=True).get(pk=pk))


def _rank_exited(
    attempt: Attempt, job: Job, node_id: int, data: protocol.JobExitedData
) -> protocol.JobExitedData | None:
    """Record one rank's exit of a job spanning nodes (attempt and job locked).

    While other ranks run, return None; if this rank failed, ask the others to stop
    (``peer_failed``): a job with a dead rank would hang in its collectives. Once
    every rank has exited, return the attempt's exit: the first failure's, else a
    clean exit at the last rank's end. A replayed rank exit changes nothing.
    """
    key = str(node_id)
    attempt.rank_exits = {**attempt.rank_exits, key: data.model_dump(mode="json")}
    attempt.save(update_fields=["rank_exits"])
    failed = data.reason != "exited" or data.exit_code != 0
    rank = attempt.node_ids.index(node_id)
    if len(attempt.rank_exits) < len(attempt.node_ids):
        if failed and not attempt.kill_reason and job.cancel_requested_at is None:
            attempt.kill_reason = "peer_failed"
            attempt.save(update_fields=["kill_reason"])
            if data.reason == "port_busy":
                name = Node.objects.values_list("name", flat=True).get(pk=node_id)
                why = f"rank {rank} not started: {data.message} on node {name}"
            else:
                why = f"rank {rank} stopped ({data.reason}, exit code {data.exit_code})"
            _event(
                job,
                f"{why}; stopping the other ranks",
                source=JobEvent.Source.AGENT,
            )
            _send_kill_on_commit(attempt, "peer_failed", job.kill_grace_s)
        return None
    exits = [
        protocol.JobExitedData.model_validate(v) for v in attempt.rank_exits.values()
    ]
    last = max(e.ended_at for e in exits)
    busy = [e for e in exits if e.reason == "port_busy"]
    if busy:  # the attempt never ran: it is relaunched, whatever the others did
        return busy[0].model_copy(update={"ended_at": last})
    failures = sorted(
        (e for e in exits if e.reason != "exited" or e.exit_code != 0),
        key=lambda e: e.ended_at,
    )
    if failures:
        return failures[0].model_copy(update={"ended_at": last})
    return data.model_copy(
        update={"exit_code": 0, "reason": "exited", "ended_at": last}
    )


def append_log(node_id: int, data: protocol.JobLogData) -> str | None:
    """Store a log chunk of the node's attempt, within the per-job size cap, and
    return the text kept (None: nothing, e.g. the cap is reached); a replayed chunk
    (same offset) is ignored (and its text returned again: pages drop a chunk
    whose offset they already have)."""
    attempt = (
        Attempt.objects.filter(pk=data.attempt_id, job_id=data.job_id)
        .only("id", "node_id", "ranks")
        .first()
    )
    if attempt is None or node_id not in attempt.node_ids or not data.data:
        return None
    stored = (
        JobLogChunk.objects.filter(attempt__job_id=data.job_id).aggregate(
            n=Sum(Func(F("data"), function="octet_length", output_field=IntegerField()))
        )["n"]
        or 0
    )
    if stored >= settings.GPULAB_LOG_MAX_BYTES:
        return None
    room = settings.GPULAB_LOG_MAX_BYTES - stored
    # Cut by bytes, never inside a UTF-8 sequence.
    text = data.data.encode("utf-8")[:room].decode("utf-8", "ignore")
    if not text:
        return None
    JobLogChunk.objects.bulk_create(
        [JobLogChunk(attempt=attempt, node_id=node_id, offset=data.offset, data=text)],
        ignore_conflicts=True,
    )
    return text


def record_progress(node_id: int, data: protocol.JobProgressData) -> bool:
    """Keep a job's latest reported progress on its attempt; True if stored.

    1. Lock the attempt: it must be this node's (same rule as ``job.log``), else
       ``FrameRefused``. For a job spanning nodes only rank 0's node is kept (its
       ranks report the same steps; mixing them would look like steps going back);
       the other ranks' reports are ignored.
    2. A report not newer than the stored one (a replay after a lost ack, or an
       older one) changes nothing.
    3. Store the latest step, total and time. The rate window starts at the first
       report and starts again when the step goes backwards (the script restarted
       from a checkpoint: its earlier speed says nothing about the new run).
    4. Add a ``ProgressSample`` if the attempt's last one is ``EVERY`` (60 s) older.
    """
    if data.at > time.time() + PROGRESS_AHEAD_S:
        raise FrameRefused(
            f"job.progress of attempt {data.attempt_id}: read at {data.at:.0f},"
            " over an hour ahead of the portal's clock"
        )
    at = _ts(data.at)
    with transaction.atomic():
        attempt = _attempt_of_node(node_id, data.attempt_id, data.job_id)
        if attempt is None:
            raise FrameRefused(
                f"job.progress: attempt {data.attempt_id} of job {data.job_id}"
                " does not run on this node"
            )
        if node_id != attempt.node_id:
            return False  # not rank 0: rank 0 speaks for the job
        if attempt.progress_at is not None and at <= attempt.progress_at:
            return False
        previous = attempt.progress_step
        if previous is None or data.step < previous:
            attempt.progress_first_step = data.step
            attempt.progress_first_at = at
        attempt.progress_step = data.step
        attempt.progress_total = data.total
        attempt.progress_at = at
        attempt.save(
            update_fields=[
                "progress_step",
                "progress_total",
                "progress_at",
                "progress_first_step",
                "progress_first_at",
            ]
        )
        last = (
            ProgressSample.objects.filter(attempt=attempt)
            .order_by("-at")
            .values_list("at", flat=True)
            .first()
        )
        if last is None or at - last >= ProgressSample.EVERY:
            ProgressSample.objects.bulk_create(
                [ProgressSample(attempt=attempt, at=at, step=data.step)],
                ignore_conflicts=True,
            )
    return True


def log_tail(job: Job, max_chars: int = 20_000) -> str:
    """The end of a job's stored output: its attempts in order; for a job spanning
    nodes, each rank's output in turn under a ``[rank N on NODE]`` header."""
    rows = list(
        JobLogChunk.objects.filter(attempt__job=job)
        .order_by("-attempt__number", "-node_id", "-offset")
        .values_list("attempt_id", "node_id", "data")[:400]
    )
    rows.reverse()
    ranks = {
        a.pk: a.node_ids
        for a in Attempt.objects.filter(pk__in={r[0] for r in rows}).only(
            "id", "node_id", "ranks"
        )
    }
    names = dict(Node.objects.values_list("pk", "name"))
    parts: list[str] = []
    current: tuple[int, int | None] | None = None
    for attempt_id, node_id, data in sorted(
        rows,
        key=lambda r: (
            r[0],
            ranks.get(r[0], []).index(r[1]) if r[1] in ranks.get(r[0], []) else 0,
        ),
    ):
        nodes = ranks.get(attempt_id, [])
        if len(nodes) > 1 and (attempt_id, node_id) != current:
            rank = nodes.index(node_id) if node_id in nodes else "?"
            if parts and not parts[-1].endswith("\n"):
                parts.append("\n")
            parts.append(f"[rank {rank} on {names.get(node_id or 0, '?')}]\n")
        current = (attempt_id, node_id)
        parts.append(data)
    return "".join(parts)[-max_chars:]
