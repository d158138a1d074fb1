"""What agents measure: GPU metrics frames (each GPU's latest state, the
history, attempts' peak memory, and the stop of a job over its declared memory on
a shared GPU) and the progress jobs report.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from scheduler import metrics as metrics_store
from scheduler.models import Allocation, Attempt, Gpu, JobEvent, Node, ProgressSample
from scheduler.services.attempts import _attempt_of_node
from scheduler.services.common import FrameRefused, _event, _send_kill_on_commit, _ts

if TYPE_CHECKING:
    from collections.abc import Iterable

    from agents import protocol

log = logging.getLogger(__name__)

# A progress report read this far ahead of the portal's clock is refused: it would
# hide every later report (older than it) from the attempt.
PROGRESS_AHEAD_S = 3600.0


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
# seven times the CPU to quote: scheduler/metrics.py ``_INSERT``).
_LATEST_SQL = """
UPDATE scheduler_gpu g SET latest = v.latest, latest_at = v.at
FROM jsonb_to_recordset(%s::jsonb) AS v(id bigint, latest jsonb, at timestamptz)
WHERE g.id = v.id AND (g.latest_at IS NULL OR g.latest_at <= v.at)
"""
# What a batch reads of its nodes' GPUs (not ``latest``: a batch only writes it,
# and decoding every GPU's stored JSON costs as much as the frames' own).
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
