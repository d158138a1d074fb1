"""The seeded completions a trace lacks: ``prepare`` filters, scales and times
the ``RawJob`` rows a reader returned and completes them (users, groups, time
limits, classes, GPU memory) into the ``SimJob`` objects the engine replays. Every
draw is seeded by (seed, job name), so each policy replays the same jobs."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.sim.jobs import PreparedTrace, SimJob
from scheduler.sim.trace import (
    DEFAULT_CLASS,
    DEFAULT_GROUP,
    THROUGHPUT_COLUMN,
    TraceError,
    reference_duration,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from agents.spec import NodeSpec
    from scheduler.sim.colocation import ColocationTable
    from scheduler.sim.jobs import RawJob
    from scheduler.sim.trace import Throughputs

LIMIT_STEPS_H = (1, 2, 4, 8, 24, 48, 72, 168)


# ------------------------------------------------------------------ completion


def user_limit_for(duration: float, factor: float) -> float:
    """A limit as a user sets it: the smallest of 1..168 h above duration x factor,
    beyond 168 h that value rounded up to a whole day."""
    target = duration * factor
    for hours in LIMIT_STEPS_H:
        if hours * 3600.0 >= target:
            return hours * 3600.0
    return math.ceil(target / 86400.0) * 86400.0


def _checkpoint_draw(seed: int, name: str) -> float:
    """A fifth uniform draw, for ``checkpointable``: keyed apart so the four of
    ``_draws`` (users, limits, classes) stay what they were."""
    digest = hashlib.blake2b(f"{seed}/{name}/checkpoint".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") / 2.0**64


def _draws(seed: int, name: str) -> tuple[float, float, float, float]:
    """Four uniform [0, 1) draws seeded by (seed, job name): the same for every
    policy and independent of which other jobs are kept."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=32).digest()
    return tuple(  # type: ignore[return-value]
        int.from_bytes(digest[i : i + 8], "big") / 2.0**64 for i in range(0, 32, 8)
    )


@dataclass(frozen=True)
class PrepareOptions:
    seed: int = 0
    vc: str | None = None
    time_scale: float = 1.0
    max_jobs: int | None = None
    no_limit_fraction: float = 0.5
    best_effort_fraction: float = 0.0
    # a preempted checkpointable job keeps its work up to its last checkpoint
    checkpointable_fraction: float = 0.0
    class_default_limit_s: float = 86400.0
    users_min: int = 5
    users_max: int = 20
    # a shareable job the trace gives no GPU memory declares this fraction of the
    # cluster's smallest GPU (None: it declares nothing, and cannot share)
    assume_memory_fraction: float | None = None


def prepare(
    fmt: str,
    raw: list[RawJob],
    nodes: Sequence[NodeSpec],
    table: Throughputs | None,
    opts: PrepareOptions,
    colocation: ColocationTable | None = None,
) -> PreparedTrace:
    """Filter (``vc``), order, cut (``max_jobs``), scale and time the rows; skip the
    ones the cluster cannot run (counted by reason); complete users and limits.

    A job is shareable if the trace's ``shareable`` column says 1, or, without that
    column, if it is a single-GPU job whose workload has rows in ``colocation`` for
    one of the cluster's GPU models (multi-GPU jobs never share)."""
    read_rows = len(raw)
    rows = [r for r in raw if opts.vc is None or r.group == opts.vc]
    outside: dict[str, int] = {}
    if len(rows) < read_rows:
        outside["other_vc"] = read_rows - len(rows)
    if not rows:
        raise TraceError(_no_rows(raw, opts.vc))
    rows.sort(key=lambda r: (r.submit, r.line))
    if opts.max_jobs is not None and len(rows) > opts.max_jobs:
        outside["beyond_max_jobs"] = len(rows) - opts.max_jobs
        rows = rows[: opts.max_jobs]
    origin = rows[0].submit if rows else 0.0
    total_gpus = sum(n.gpus for n in nodes)
    max_mem = max((n.memory_mib for n in nodes), default=0)
    skipped: Counter[str] = Counter()
    assumptions: list[str] = []
    groups_users: dict[str, int] = {}
    groups_cum: dict[str, list[float]] = {}
    jobs: list[SimJob] = []
    assumed_mib = (
        int(opts.assume_memory_fraction * min(n.memory_mib for n in nodes))
        if opts.assume_memory_fraction is not None and nodes
        else None
    )
    assumed = 0
    shareable_workloads = (
        colocation.workloads(n.model for n in nodes)
        if colocation is not None
        else frozenset()
    )
    needs_table = any(r.duration is None for r in rows)
    if needs_table and table is None:
        raise TraceError(
            "the trace gives steps, not durations: pass --throughputs FILE"
        )
    for r in rows:
        if r.gpus > total_gpus:
            skipped["more_gpus_than_cluster"] += 1
            continue
        if r.gpu_mem_mib is not None and r.gpu_mem_mib > max_mem:
            skipped["more_memory_than_any_gpu"] += 1
            continue
        if r.duration is not None:
            duration = r.duration
        else:
            assert table is not None and r.steps is not None
            ref = reference_duration(table, nodes, r.workload, r.gpus, r.steps)
            if ref is None:
                skipped["no_throughput_for_gpu_count"] += 1
                continue
            duration = ref
        if duration <= 0:
            skipped["zero_duration"] += 1
            continue
        factor_u, no_limit_u, user_draw, best_effort_u = _draws(opts.seed, r.name)
        factor = 1.1 + 0.9 * factor_u
        no_limit = no_limit_u < opts.no_limit_fraction
        best_effort = best_effort_u < opts.best_effort_fraction
        group = r.group or DEFAULT_GROUP
        user = r.user
        if not user:
            cumulative = groups_cum.get(group)
            if cumulative is None:
                grng = random.Random(f"{opts.seed}/users/{group}")
                count = grng.randint(opts.users_min, opts.users_max)
                groups_users[group] = count
                # Zipf-like: user k is picked with weight 1/k.
                weights = [1.0 / (i + 1) for i in range(count)]
                total = sum(weights)
                cumulative = list(itertools.accumulate(w / total for w in weights))
                groups_cum[group] = cumulative
            pick = min(bisect.bisect_right(cumulative, user_draw), len(cumulative) - 1)
            user = f"{group}-u{pick + 1}"
        if r.time_limit is not None:
            limit, user_limit = r.time_limit, True
        elif no_limit:
            limit, user_limit = opts.class_default_limit_s, False
        else:
            limit, user_limit = user_limit_for(duration, factor), True
        cls = r.priority or ("best-effort" if best_effort else DEFAULT_CLASS)
        checkpointable = (
            r.checkpointable
            if r.checkpointable is not None
            else opts.checkpointable_fraction > 0
            and _checkpoint_draw(opts.seed, r.name) < opts.checkpointable_fraction
        )
        shareable = (
            r.shareable
            if r.shareable is not None
            else r.gpus == 1 and r.workload in shareable_workloads
        )
        mem = r.gpu_mem_mib
        if mem is None and shareable and assumed_mib is not None:
            mem, assumed = assumed_mib, assumed + 1
        jobs.append(
            SimJob(
                id=len(jobs) + 1,
                name=r.name,
                submit=(r.submit - origin) * opts.time_scale,
                gpus=r.gpus,
                ref_duration=duration,
                user=user,
                group=group,
                label=r.workload,
                priority_class=cls,
                time_limit=limit,
                user_limit=user_limit,
                gpu_mem_mib=mem,
                shareable=shareable,
                steps=r.steps if r.duration is None else None,
                checkpointable=checkpointable,
                checkpoint_interval_s=r.checkpoint_interval_s,
            )
        )
    if not jobs:
        raise TraceError(_all_skipped(rows, skipped, nodes, table))
    if groups_users:
        assumptions.append(
            "users: the trace names none; each group gets a seeded "
            f"{opts.users_min}-{opts.users_max} users, picked Zipf-like (1/rank): "
            + ", ".join(f"{g}={n}" for g, n in sorted(groups_users.items()))
        )
    if any(r.time_limit is None for r in rows):
        assumptions.append(
            "time limits: where the trace has none, a seeded "
            f"{opts.no_limit_fraction:g} of jobs have no limit (class default "
            f"{opts.class_default_limit_s:g} s, enforced); the others the smallest of "
            "1,2,4,8,24,48,72,168 h above true duration x U[1.1,2.0] (seeded per job; "
            "beyond 168 h rounded up to whole days), the same for every policy"
        )
    if needs_table:
        assumptions.append(
            f"durations: steps / {THROUGHPUT_COLUMN} for the cluster's first GPU "
            "model with a throughput (consolidated rows when the job fits one node, "
            "<model>_unconsolidated otherwise); at start the placement's model and "
            "node count select the row"
        )
    if colocation is not None and any(r.shareable is None for r in rows):
        assumptions.append(
            "shareable: without a 'shareable' column, a single-GPU job whose "
            "workload has rows in the co-location table for the cluster's GPU "
            f"model ({sum(j.shareable for j in jobs)} of {len(jobs)} jobs)"
        )
    if assumed:
        assumptions.append(
            f"memory: {assumed} shareable jobs the trace gives no GPU memory declare "
            f"{assumed_mib} MiB ({opts.assume_memory_fraction:g} of the smallest "
            "GPU); whether a pair truly fits is the co-location table's 'feasible'"
        )
    if opts.checkpointable_fraction > 0:
        assumptions.append(
            f"checkpointable: a seeded {opts.checkpointable_fraction:g} of the jobs "
            "the trace does not mark "
            f"({sum(j.checkpointable for j in jobs)} of {len(jobs)}); a preempted one "
            "keeps its work up to its last checkpoint and pays a restart overhead"
        )
    span = (jobs[-1].submit - jobs[0].submit) if len(jobs) > 1 else 0.0
    asked = sum(j.gpus * j.ref_duration for j in jobs)
    load = asked / (total_gpus * span) if span > 0 and total_gpus else 0.0
    return PreparedTrace(
        jobs=jobs,
        format=fmt,
        read_rows=read_rows,
        skipped=dict(sorted(skipped.items())),
        offered_load=load,
        span_s=span,
        assumptions=assumptions,
        outside_case=outside,
    )


def _no_rows(raw: list[RawJob], vc: str | None) -> str:
    if not raw:
        return "the trace has no job rows"
    groups = sorted({r.group for r in raw if r.group})
    shown = ", ".join(groups[:20]) + (", ..." if len(groups) > 20 else "")
    return (
        f"no row of the trace is in virtual cluster {vc!r} "
        f"({len(raw)} rows; its virtual clusters: {shown or 'none named'})"
    )


def _all_skipped(
    rows: list[RawJob],
    skipped: Counter[str],
    nodes: Sequence[NodeSpec],
    table: Throughputs | None,
) -> str:
    """Why every row was skipped, naming the mismatch behind each reason."""
    counts = ", ".join(f"{k}: {n}" for k, n in sorted(skipped.items()))
    why = []
    models = sorted({n.model.lower() for n in nodes})
    if skipped.get("no_throughput_for_gpu_count") and table is not None:
        have = sorted({m for m, _, _ in table if not m.endswith("_unconsolidated")})
        workloads = sorted({r.workload for r in rows if r.duration is None})
        matched = [m for m in models if m in have]
        if not matched:
            why.append(
                f"the throughput table has no rows for the cluster's GPU model(s) "
                f"{', '.join(models)} (its models: {', '.join(have) or 'none'})"
            )
        else:
            why.append(
                f"the throughput table has no row for these jobs' workloads and GPU "
                f"counts on {', '.join(matched)} (workloads: {', '.join(workloads[:10])})"
            )
    if skipped.get("more_gpus_than_cluster"):
        total = sum(n.gpus for n in nodes)
        smallest = min(r.gpus for r in rows)
        why.append(
            f"the cluster has {total} GPUs and the smallest job asks for {smallest}"
        )
    if skipped.get("more_memory_than_any_gpu"):
        why.append(
            f"the largest GPU has {max(n.memory_mib for n in nodes)} MiB, less than "
            "every job asks"
        )
    return f"every one of the {len(rows)} rows of the case was skipped ({counts})" + (
        ": " + "; ".join(why) if why else ""
    )
