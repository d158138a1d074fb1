"""Measuring co-location in production: solo rates, sharing episodes, observations.

What the portal can measure is the progress a job reports (``GPULAB_PROGRESS``
lines: ``Attempt.progress_*`` and a ``ProgressSample`` a minute). From it:

- an attempt's **solo rate**: steps/s from its first report until another job joined
  its GPU (``Attempt.shared_at``) or it ended; stored on the attempt when it ends
  (``Attempt.solo_rate``). A workload's solo rate is the median of its last
  ``SOLO_HISTORY`` attempts' (any user: the label names the workload);
- a **sharing episode**: while two attempts hold one GPU, from the later one's start
  to the first one's end. An attempt's rate over the episode divided into its
  workload's solo rate is its **measured slowdown**;
- when an episode ends (either attempt ends) and lasted ``MIN_EPISODE`` or more with
  both rates known, one **observation** per direction goes into ``InterferencePair``
  (log slowdown, merged with Welford's update under the row's lock), in the
  transaction that ends the attempt: an episode is observed once, never twice;
- for a running shared attempt, the snapshot computes the measured slowdown so far
  (``measured``), which the policy's eviction rule reads.

What the agents sample (per-process SM utilisation in the persisted GPU samples)
gives two more things, both weaker:

- an attempt's **solo busy fraction**: the mean of its processes' SM utilisation
  over the last ``BUSY_WINDOW`` of its solo window, kept when it ends
  (``Attempt.solo_busy``); a workload's is the median of its last ``SOLO_HISTORY``
  attempts' (``solo_busies``): the interference model's prior reads it;
- for an episode direction without a progress rate (the job reports no progress),
  its slowdown read from utilisation: its workload's solo busy fraction over its
  busy fraction during the episode (time-sliced kernels spread the same work over
  a longer time). It goes into the row's weak evidence (``util_*``), which the
  model counts at a fraction of an observation. Eviction reads progress only.
"""

from __future__ import annotations

import math
import statistics
from datetime import datetime, timedelta
from itertools import pairwise
from typing import TYPE_CHECKING

from django.db import connection, transaction
from django.db.models import F, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from scheduler.models import Allocation, Attempt, InterferencePair, ProgressSample
from scheduler.policy.interference import Observations

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

SOLO_HISTORY = 10  # attempts a workload's solo rate is the median of
MIN_EPISODE = timedelta(minutes=5)  # shorter episodes are not observed
MIN_WINDOW_S = 120.0  # a rate needs reports this far apart
BUSY_WINDOW = timedelta(hours=1)  # a solo busy fraction reads at most this much
MIN_BUSY_SAMPLES = 3  # persisted samples a busy fraction needs


def rate(
    points: Sequence[tuple[datetime, int]], t0: datetime, t1: datetime
) -> float | None:
    """Steps/s between the first report at or after ``t0`` and the last at or
    before ``t1``; None with fewer than two reports ``MIN_WINDOW_S`` apart or a
    step going backwards (a restart from a checkpoint) in the window."""
    inside = [(at, step) for at, step in points if t0 <= at <= t1]
    if len(inside) < 2:
        return None
    (a0, s0), (a1, s1) = inside[0], inside[-1]
    seconds = (a1 - a0).total_seconds()
    if seconds < MIN_WINDOW_S or any(
        later[1] < earlier[1] for earlier, later in pairwise(inside)
    ):
        return None
    return (s1 - s0) / seconds


def _points(attempts: Iterable[Attempt]) -> dict[int, list[tuple[datetime, int]]]:
    """Each attempt's reports in time order: its samples and its latest report."""
    attempts = list(attempts)
    out: dict[int, list[tuple[datetime, int]]] = {a.pk: [] for a in attempts}
    for attempt_id, at, step in ProgressSample.objects.filter(
        attempt_id__in=list(out)
    ).values_list("attempt_id", "at", "step"):
        out[attempt_id].append((at, step))
    for a in attempts:
        if a.progress_at is not None and a.progress_step is not None:
            out[a.pk].append((a.progress_at, a.progress_step))
        out[a.pk].sort()
    return out


def _recent_medians(field: str, workloads: Iterable[str]) -> dict[str, float]:
    """Per workload, the median of ``field`` over its last ``SOLO_HISTORY``
    attempts that measured one (by end time). One query for all of them."""
    wanted = {w for w in workloads if w}
    if not wanted:
        return {}
    recent = (
        Attempt.objects.filter(job__workload__in=wanted, **{f"{field}__isnull": False})
        .annotate(
            nth=Window(
                RowNumber(),
                partition_by=F("job__workload"),
                order_by=F("ended_at").desc(),
            )
        )
        .filter(nth__lte=SOLO_HISTORY)
        .values_list("job__workload", field)
    )
    found: dict[str, list[float]] = {}
    for w, x in recent:
        if x is not None:
            found.setdefault(w, []).append(x)
    return {w: statistics.median(xs) for w, xs in found.items()}


def solo_rates(workloads: Iterable[str]) -> dict[str, float]:
    """Each workload's solo rate (steps/s): the median over its last
    ``SOLO_HISTORY`` attempts that measured one. One query for all of them."""
    return _recent_medians("solo_rate", workloads)


def solo_busies(workloads: Iterable[str]) -> dict[str, float]:
    """Each workload's solo busy fraction (0-1): the median over its last
    ``SOLO_HISTORY`` attempts that measured one. One query for all of them."""
    return _recent_medians("solo_busy", workloads)


# Per persisted sample, the SM utilisation of each wanted attempt's processes on
# that GPU (summed: a job may run several processes), then averaged per attempt.
# A process whose utilisation NVML did not report (null) is left out; a sample in
# which none of the attempt's processes had one is not counted.
_BUSY_SQL = """
SELECT aid, avg(util), count(*) FROM (
    SELECT (p->>'attempt_id')::bigint AS aid, s.gpu_id, s.at,
           sum((p->>'sm_util')::float) AS util
    FROM scheduler_gpusample s, jsonb_array_elements(s.processes) p
    WHERE s.gpu_id = ANY(%s) AND s.at >= %s AND s.at <= %s
      AND (p->>'attempt_id')::bigint = ANY(%s)
      AND jsonb_typeof(p->'sm_util') = 'number'
    GROUP BY 1, 2, 3
) per_sample
GROUP BY aid
"""


def busy_fractions(
    attempt_ids: Iterable[int], gpu_ids: Iterable[int], t0: datetime, t1: datetime
) -> dict[int, float]:
    """The mean fraction of time (0-1) each attempt's processes kept their GPU busy
    between ``t0`` and ``t1``, from the persisted samples of ``gpu_ids`` (one
    query); attempts with fewer than ``MIN_BUSY_SAMPLES`` samples are left out."""
    aids, gids = sorted(set(attempt_ids)), sorted(set(gpu_ids))
    if not aids or not gids or t1 <= t0:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(_BUSY_SQL, [gids, t0, t1, aids])
        rows = cursor.fetchall()
    return {
        int(aid): min(max(float(util) / 100.0, 0.0), 1.0)
        for aid, util, count in rows
        if count >= MIN_BUSY_SAMPLES
    }


def _keep_solo_busy(attempt: Attempt, gpu_ids: list[int], ended: datetime) -> None:
    """Its busy fraction over the last ``BUSY_WINDOW`` of its solo window."""
    if not attempt.job.workload:
        return
    solo_end = attempt.shared_at or ended
    solo_start = max(attempt.started_at or attempt.created_at, solo_end - BUSY_WINDOW)
    got = busy_fractions([attempt.pk], gpu_ids, solo_start, solo_end).get(attempt.pk)
    if got is not None:
        attempt.solo_busy = got
        attempt.save(update_fields=["solo_busy"])


def record_episode_ends(attempt: Attempt, ended: datetime) -> int:
    """``attempt`` ends at ``ended``: keep its solo rate, and observe each sharing
    episode it was part of that lasted ``MIN_EPISODE``. Runs in the transaction
    that ends the attempt. Returns the observations written."""
    gpu_ids = list(
        Allocation.objects.filter(attempt=attempt).values_list("gpu_id", flat=True)
    )
    _keep_solo_busy(attempt, gpu_ids, ended)
    if attempt.progress_at is None and attempt.shared_at is None:
        return 0  # reported nothing and shared with nobody: nothing more to learn
    points = _points([attempt])[attempt.pk]
    if points:
        solo_end = attempt.shared_at or ended
        solo = rate(points, points[0][0], solo_end)
        if solo is not None and solo > 0:
            attempt.solo_rate = solo
            attempt.save(update_fields=["solo_rate"])
    if attempt.shared_at is None:
        return 0
    partners = list(
        Attempt.objects.filter(
            allocations__gpu_id__in=gpu_ids,
            created_at__lt=ended,
        )
        .exclude(pk=attempt.pk)
        .exclude(ended_at__lt=attempt.created_at)
        .select_related("job")
        .distinct()
    )
    if not partners:
        return 0
    everyone = [attempt, *partners]
    pts = _points(partners)  # its own are read already
    pts[attempt.pk] = points
    workloads = {a.job.workload for a in everyone}
    solos = solo_rates(workloads)
    busies: dict[str, float] | None = None  # read only if some job lacks progress
    written = 0
    for other in partners:
        start = max(attempt.created_at, other.created_at)
        end = min(ended, other.ended_at or ended)
        if end - start < MIN_EPISODE:
            continue
        for a, b in ((attempt, other), (other, attempt)):
            wa, wb = a.job.workload, b.job.workload
            if not wa or not wb:
                continue
            shared = rate(pts[a.pk], start, end)
            solo = solos.get(wa)
            if shared is not None and shared > 0 and solo is not None:
                observe(wa, wb, math.log(solo / shared))
                written += 1
                continue
            # no progress to go by: what its processes' utilisation showed
            if busies is None:
                busies = solo_busies(workloads)
            solo_busy = busies.get(wa)
            now_busy = busy_fractions([a.pk], gpu_ids, start, end).get(a.pk)
            if solo_busy and now_busy:
                observe(wa, wb, math.log(solo_busy / now_busy), weak=True)
                written += 1
    return written


def observe(
    workload_a: str, workload_b: str, log_slowdown: float, *, weak: bool = False
) -> None:
    """Merge one observation of A's log slowdown beside B into its row (Welford's
    update, ``Observations.add``, under the row's lock: two episodes may end at
    once); ``weak``: one read from utilisation, into the row's weak evidence."""
    fields = ("util_n", "util_mean_log", "util_m2") if weak else ("n", "mean_log", "m2")
    with transaction.atomic():
        InterferencePair.objects.get_or_create(
            workload_a=workload_a, workload_b=workload_b
        )
        row = InterferencePair.objects.select_for_update().get(
            workload_a=workload_a, workload_b=workload_b
        )
        merged = Observations(*(getattr(row, f) for f in fields)).add(log_slowdown)
        for f, value in zip(fields, (merged.n, merged.mean, merged.m2), strict=True):
            setattr(row, f, value)
        row.updated_at = timezone.now()
        row.save(update_fields=[*fields, "updated_at"])


def measured(
    live: Sequence[tuple[int, int, Attempt]], now: datetime
) -> dict[int, tuple[float, float]]:
    """For running attempts on shared GPUs (``(gpu id, job id, attempt)`` for every
    live allocation's attempt), each job's measured slowdown over its current
    episode and how long it was measured: ``{job id: (slowdown, seconds)}``."""
    by_gpu: dict[int, list[Attempt]] = {}
    for gpu_id, _job_id, attempt in live:
        group = by_gpu.setdefault(gpu_id, [])
        if attempt not in group:
            group.append(attempt)
    shared = {gid: atts for gid, atts in by_gpu.items() if len(atts) > 1}
    if not shared:
        return {}
    attempts = [a for atts in shared.values() for a in atts]
    pts = _points(attempts)
    solos = solo_rates(a.job.workload for a in attempts)
    out: dict[int, tuple[float, float]] = {}
    for atts in shared.values():
        start = max(a.created_at for a in atts)
        for a in atts:
            solo = solos.get(a.job.workload)
            r = rate(pts[a.pk], start, now)
            if solo is None or r is None or r <= 0:
                continue
            window = [at for at, _ in pts[a.pk] if start <= at <= now]
            out[a.job_id] = (solo / r, (window[-1] - window[0]).total_seconds())
    return out


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
