"""The ordering stage: multifactor priority (Slurm's priority/multifactor): each factor is
normalised to [0, 1] and multiplied by its weight from ``PolicyConfig``; the weighted
parts are kept as the breakdown ``sprio`` would show, and their sum is the priority.

- class: ``ClassSpec.weight`` of the job's class, else ``PendingJob.priority_weight``;
- age: ``min(1, (now - submitted_at) / max_age_s)``; it saturates at ``max_age_s``.
  An aged job gains at most ``weight_age``: with the defaults (class 1000, age 500)
  a ``normal`` job (class 0.5) reaches a brand-new ``high`` job (class 1.0) after
  ``max_age_s`` (7 days) and then goes first (older wins ties); ``best-effort``
  reaches a new ``normal`` job the same way. Within a class, later jobs never pass an
  older one on age. ``best-effort`` never passes ``high`` on age alone: it is the
  scavenger class, started by backfill and preempted when a higher class waits;
- fairshare: ``fairshare.FairShare.of(group, user)``;
- runtime (``gpulab`` only; Slurm has no such factor): shorter planned run times
  (``PendingJob.planned_s``: min(limit, prediction)) first, on a log scale
  (``runtime_factor``; 0 from ``runtime_ref_s``, 6 h by default, on: jobs planned
  longer than that are not reordered among themselves, which bounds how long a
  stream of shorter jobs can hold a long one back), times ``1 - age factor``: a
  head start for short jobs that
  age takes over; a job that has waited ``max_age_s`` gets the whole
  ``weight_runtime``, as if it were the shortest job. Ordering short jobs first cuts
  the average completion time (shortest-job-first); the step at ``max_age_s`` keeps
  the crossings above whatever the run times: with the defaults a max-aged job
  (age 500 + runtime 500) passes every newer job of its class and of the class
  just above (whose runtime part is below 500 unless it is planned to take no
  time), and never one two classes up (``gpulab`` breaks exact ties by class).
  With ``runtime_age_gpu_s`` set, a waiting job's runtime part is at least
  ``weight_runtime`` x min(1, GPUs x time waited / ``runtime_age_gpu_s``): the
  head start is earned by waiting too, faster for wider jobs, whose wait costs
  more GPUs (``waited_head_start``); with ``runtime_age_min_gpus``, only jobs of
  at least that many GPUs earn it (the wide jobs a stream of narrow ones keeps
  from whole nodes; the narrow ones fit in the gaps they leave);
- size: ``gpus / all GPUs of the cluster`` (capped at 1). Like Slurm's default
  (PriorityFavorSmall=NO) it favours larger jobs: small jobs already win through
  backfill and best fit, large ones need the push so they are not starved by a
  stream of small ones.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from scheduler.policy.fairshare import FairShare
    from scheduler.policy.state import ClassSpec, PendingJob, PolicyConfig


def clamp(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def class_factor(
    job_class: str, fallback: float, classes: Mapping[str, ClassSpec]
) -> float:
    spec = classes.get(job_class)
    return clamp(spec.weight if spec is not None else fallback)


def age_factor(now: float, submitted_at: float, max_age_s: float) -> float:
    if max_age_s <= 0:
        return 1.0
    return clamp((now - submitted_at) / max_age_s)


def size_factor(gpus: int, total_gpus: int) -> float:
    return clamp(gpus / total_gpus) if total_gpus > 0 else 0.0


def runtime_factor(planned_s: float, ref_s: float) -> float:
    """1 for a job planned to take no time, 0 at ``ref_s`` and beyond, on a log
    scale (run times span seconds to weeks): with the default 6-h ``ref_s``,
    1 min 0.88, 10 min 0.59, 1 h 0.30, 2 h 0.19, 4 h 0.07, 6 h and more 0 (the
    shortest-first head start only reorders short jobs; among long ones the order
    is ``slurm``'s)."""
    if ref_s <= 60.0:
        return 0.0
    return clamp(1.0 - math.log1p(planned_s / 60.0) / math.log1p(ref_s / 60.0))


def waited_head_start(
    now: float,
    submitted_at: float,
    gpus: int,
    runtime_age_gpu_s: float,
    min_gpus: int = 1,
) -> float:
    """The run-time factor a job has earned by waiting: GPUs x seconds waited over
    ``runtime_age_gpu_s``, capped at 1; 0 when the rule is off or the job has
    fewer than ``min_gpus`` GPUs. An 8-GPU job earns the shortest job's head start
    eight times sooner than a 1-GPU job."""
    if runtime_age_gpu_s <= 0 or gpus < min_gpus:
        return 0.0
    return clamp((now - submitted_at) * max(gpus, 1) / runtime_age_gpu_s)


def runtime_share(factor: float, age_x: float, earned: float) -> float:
    """The run-time part's share of ``weight_runtime``: the job's own
    ``runtime_factor`` fading as age (``age_x``, the age factor) takes over, at
    least what it ``earned`` by waiting; the whole weight at max age."""
    if age_x >= 1.0:
        return 1.0
    own = factor * (1.0 - age_x)
    return earned if earned > own else own


def breakdown(
    job: PendingJob,
    *,
    now: float,
    config: PolicyConfig,
    classes: Mapping[str, ClassSpec],
    fairshare: FairShare,
    total_gpus: int,
    runtime: bool = False,
) -> dict[str, float]:
    """The weighted factors of one pending job; ``sum(...)`` is its priority.
    ``runtime``: include the run-time factor (``gpulab``; ``slurm`` has none)."""
    out = {
        "class": config.weight_class
        * class_factor(job.priority_class, job.priority_weight, classes),
        "age": config.weight_age * age_factor(now, job.submitted_at, config.max_age_s),
        "fairshare": config.weight_fairshare * fairshare.of(job.group, job.user),
        "size": config.weight_size * size_factor(job.gpus, total_gpus),
    }
    if runtime and config.weight_runtime:
        x = age_factor(now, job.submitted_at, config.max_age_s)
        earned = waited_head_start(
            now,
            job.submitted_at,
            job.gpus,
            config.runtime_age_gpu_s,
            config.runtime_age_min_gpus,
        )
        out["runtime"] = config.weight_runtime * runtime_share(
            runtime_factor(job.planned_s, config.runtime_ref_s), x, earned
        )
    return out


def breakdowns(
    jobs: Iterable[PendingJob],
    *,
    now: float,
    config: PolicyConfig,
    classes: Mapping[str, ClassSpec],
    fairshare: FairShare,
    total_gpus: int,
    runtime: bool = False,
) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """``breakdown`` for many jobs (the same numbers) and each one's priority (the
    sum). The class, fair-share and size parts are cached per class, user and size:
    a pass has few of each and many jobs."""
    w_age = config.weight_age
    w_run = config.weight_runtime if runtime else 0.0
    ref = config.runtime_ref_s
    age_gpu_s = config.runtime_age_gpu_s
    min_gpus = config.runtime_age_min_gpus
    run_part: dict[float, float] = {}
    max_age = config.max_age_s
    cls_part: dict[tuple[str, float], float] = {}
    fs_part: dict[tuple[str, str], float] = {}
    size_part: dict[int, float] = {}
    out: dict[int, dict[str, float]] = {}
    prio: dict[int, float] = {}
    for job in jobs:
        ck = (job.priority_class, job.priority_weight)
        c = cls_part.get(ck)
        if c is None:
            c = cls_part[ck] = config.weight_class * class_factor(*ck, classes)
        fk = (job.group, job.user)
        f = fs_part.get(fk)
        if f is None:
            f = fs_part[fk] = config.weight_fairshare * fairshare.of(*fk)
        gpus = job.gpus
        z = size_part.get(gpus)
        if z is None:
            z = size_part[gpus] = config.weight_size * size_factor(gpus, total_gpus)
        if max_age > 0:
            x = (now - job.submitted_at) / max_age
            x = 0.0 if x < 0.0 else 1.0 if x > 1.0 else x
        else:
            x = 1.0
        a = w_age * x
        if w_run:
            rf = run_part.get(job.planned_s)
            if rf is None:
                rf = run_part[job.planned_s] = runtime_factor(job.planned_s, ref)
            earned = (
                waited_head_start(now, job.submitted_at, gpus, age_gpu_s, min_gpus)
                if age_gpu_s > 0
                else 0.0
            )
            r = w_run * runtime_share(rf, x, earned)
            out[job.id] = {
                "class": c, "age": a, "fairshare": f, "size": z, "runtime": r
            }  # fmt: skip
            prio[job.id] = c + a + f + z + r
        else:
            out[job.id] = {"class": c, "age": a, "fairshare": f, "size": z}
            prio[job.id] = c + a + f + z
    return out, prio
