"""Trace readers: the canonical CSV, Philly (Pollux's ``philly.csv``) and Gavel's
Philly-VC traces, plus the seeded completions a trace lacks (users, time limits).

Everything here is pure Python (``csv``, no Django). A reader returns ``RawJob`` rows;
``prepare`` filters, scales, times and completes them into ``SimJob`` objects that the
engine replays. Bad input raises ``TraceError`` naming the file and line.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from collections.abc import Generator, Sequence

    from agents.spec import NodeSpec
    from scheduler.sim.colocation import ColocationTable, Segment

CANONICAL_REQUIRED = ("job_id", "submit_time", "num_gpus")
PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "cluster")
GAVEL_COLUMNS = ("vc", "job_type", "total_steps", "arrival_time_s", "scale_factor")
THROUGHPUT_COLUMN = "isolated_steps_per_sec_simulation_json"
THROUGHPUT_FALLBACK_COLUMN = "isolated_steps_per_sec_physical_json"
FORMATS = ("auto", "canonical", "philly", "gavel")
LIMIT_STEPS_H = (1, 2, 4, 8, 24, 48, 72, 168)
CLASS_NAMES = ("high", "normal", "best-effort")
DEFAULT_CLASS = "normal"
DEFAULT_GROUP = "default"


Rows: TypeAlias = "Generator[tuple[int, dict[str, str | None]], None, None]"


class TraceError(ValueError):
    """A trace or table the simulator cannot read; the message names file and line."""


@dataclass
class RawJob:
    """One trace row as read, before timing and completion."""

    name: str
    line: int
    submit: float
    gpus: int
    duration: float | None = None
    workload: str = ""
    steps: float | None = None
    user: str = ""
    group: str = ""
    gpu_mem_mib: int | None = None
    time_limit: float | None = None
    priority: str = ""
    shareable: bool | None = None  # None: the trace has no ``shareable`` column


@dataclass(eq=False)
class SimJob:
    """A job as the simulator replays it; ``ref_duration`` is the ground truth the
    policy never sees (a workload job's actual run time depends on its placement)."""

    id: int
    name: str
    submit: float
    gpus: int
    ref_duration: float
    user: str
    group: str
    label: str
    priority_class: str
    time_limit: float  # the enforced limit (the class default when none was set)
    user_limit: bool  # the user set the limit
    gpu_mem_mib: int | None = None
    shareable: bool = False
    steps: float | None = None  # workload jobs: steps / throughput(placement)
    # --- physics and bookkeeping, owned by the engine
    state: str = "future"  # future | pending | running | stopping | done
    outcome: str = ""  # completed | timeout
    attempt: int = 0
    started_at: float = 0.0
    first_start: float | None = None
    end: float = 0.0
    run_duration: float = 0.0  # true duration of the current attempt
    run_total: float = 0.0  # seconds run over all attempts
    gpu_ids: tuple[int, ...] = ()
    planned_s: float = 0.0
    pred_source: str = "default"
    pred_version: int = -1
    preemptions: int = 0
    preempt_times: list[float] = field(default_factory=list)
    first_est: float | None = None
    last_reason: str = ""
    # --- co-location physics (engine): work in solo-seconds, done at ``rate``
    epoch: int = 0  # bumped at every (re)scheduled end: stale END events skip
    slots_taken: int = 0  # per GPU: 1 for a shareable single-GPU job, else all
    done_work: float = 0.0  # solo-seconds done in this attempt up to rate_since
    rate: float = 1.0
    rate_since: float = 0.0
    end_cause: str = ""  # completed | timeout: what the scheduled END is
    usage_w: float = 0.0  # GPUs charged to its group (1/n on a GPU shared by n)
    partners: tuple[int, ...] = ()
    segment: Segment | None = None
    joined_at: float | None = None
    trial: bool = False
    doomed: bool = False  # joined a partner it cannot fit beside: fails at start
    progress_from: float = 0.0  # its start, or when the partner it could not fit
    # beside left before it failed
    shared_attempt: bool = False  # shared a GPU during this attempt
    shared_s: float = 0.0  # seconds spent sharing, all attempts
    max_true_slowdown: float = 1.0  # worst 1/rate of its sharing episodes
    over_cap_s: float = 0.0  # longest sharing episode truly over its cap


@dataclass
class PreparedTrace:
    jobs: list[SimJob]
    format: str
    read_rows: int
    skipped: dict[str, int]
    offered_load: float
    span_s: float
    assumptions: list[str]
    throughput_fallbacks: int = 0


# ------------------------------------------------------------------ parsing helpers


def _num(path: str, line: int, column: str, text: str | None) -> float:
    if text is None or text.strip() == "":
        raise TraceError(f"{path}:{line}: column {column!r} is empty")
    try:
        value = float(text)
    except ValueError:
        raise TraceError(
            f"{path}:{line}: column {column!r} is not a number: {text!r}"
        ) from None
    if not math.isfinite(value):
        raise TraceError(f"{path}:{line}: column {column!r} is not finite: {text!r}")
    return value


def _nonneg(path: str, line: int, column: str, text: str | None) -> float:
    value = _num(path, line, column, text)
    if value < 0:
        raise TraceError(f"{path}:{line}: column {column!r} is negative: {text!r}")
    return value


def _count(path: str, line: int, column: str, text: str | None) -> int:
    value = _num(path, line, column, text)
    if value < 1 or value != int(value):
        raise TraceError(
            f"{path}:{line}: column {column!r} must be a whole number >= 1: {text!r}"
        )
    return int(value)


def _opt(row: dict[str, str | None], column: str) -> str:
    value = row.get(column)
    return value.strip() if value else ""


def _open_rows(
    path: str,
) -> tuple[list[str], Rows]:
    try:
        handle = Path(path).open(newline="", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror}") from None
    reader = csv.DictReader(handle)
    try:
        header = [h.strip() for h in (reader.fieldnames or [])]
    except (csv.Error, UnicodeDecodeError) as exc:
        handle.close()
        raise TraceError(f"{path}:1: unreadable header: {exc}") from None
    if not header:
        handle.close()
        raise TraceError(f"{path}:1: empty file, expected a header line")
    reader.fieldnames = header

    def rows() -> Rows:
        with handle:
            try:
                for row in reader:
                    yield reader.line_num, row
            except (csv.Error, UnicodeDecodeError) as exc:
                raise TraceError(f"{path}:{reader.line_num}: {exc}") from None

    return header, rows()


def detect_format(header: Sequence[str]) -> str | None:
    cols = set(header)
    if set(CANONICAL_REQUIRED) <= cols:
        return "canonical"
    if set(PHILLY_COLUMNS) <= cols:
        return "philly"
    if set(GAVEL_COLUMNS) <= cols:
        return "gavel"
    return None


def _require(
    path: str, header: Sequence[str], columns: Sequence[str], fmt: str
) -> None:
    missing = [c for c in columns if c not in header]
    if missing:
        raise TraceError(
            f"{path}:1: {fmt} trace is missing column(s) {', '.join(missing)}"
        )


# ------------------------------------------------------------------ readers


def read_trace(path: str, fmt: str = "auto") -> tuple[str, list[RawJob]]:
    """Read ``path`` in ``fmt`` (or the format its header shows)."""
    header, rows = _open_rows(path)
    if fmt == "auto":
        detected = detect_format(header)
        if detected is None:
            rows.close()
            raise TraceError(
                f"{path}:1: unknown trace format; a canonical trace needs the columns "
                f"{', '.join(CANONICAL_REQUIRED)} and duration or workload+steps "
                f"(found: {', '.join(header)})"
            )
        fmt = detected
    reader = {"canonical": _canonical, "philly": _philly, "gavel": _gavel}.get(fmt)
    if reader is None:
        rows.close()
        raise TraceError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt, reader(path, header, rows)


def _canonical(path: str, header: list[str], rows: Rows) -> list[RawJob]:
    _require(path, header, CANONICAL_REQUIRED, "canonical")
    if "duration" not in header and not {"workload", "steps"} <= set(header):
        raise TraceError(
            f"{path}:1: canonical trace needs a 'duration' column or both "
            "'workload' and 'steps'"
        )
    jobs = []
    for line, row in rows:
        name = _opt(row, "job_id")
        if not name:
            raise TraceError(f"{path}:{line}: column 'job_id' is empty")
        job = RawJob(
            name=name,
            line=line,
            submit=_nonneg(path, line, "submit_time", row.get("submit_time")),
            gpus=_count(path, line, "num_gpus", row.get("num_gpus")),
            user=_opt(row, "user"),
            group=_opt(row, "group"),
        )
        duration = _opt(row, "duration")
        if duration:
            job.duration = _nonneg(path, line, "duration", duration)
            if job.duration <= 0:
                raise TraceError(f"{path}:{line}: column 'duration' must be > 0")
        else:
            job.workload = _opt(row, "workload")
            if not job.workload:
                raise TraceError(
                    f"{path}:{line}: neither 'duration' nor 'workload'+'steps' is set"
                )
            job.steps = _nonneg(path, line, "steps", row.get("steps"))
        if duration and _opt(row, "workload"):
            job.workload = _opt(row, "workload")  # a label only
        mem = _opt(row, "gpu_mem_mib")
        if mem:
            job.gpu_mem_mib = _count(path, line, "gpu_mem_mib", mem)
        limit = _opt(row, "time_limit")
        if limit:
            job.time_limit = _nonneg(path, line, "time_limit", limit)
            if job.time_limit <= 0:
                raise TraceError(f"{path}:{line}: column 'time_limit' must be > 0")
        prio = _opt(row, "priority")
        if prio and prio not in CLASS_NAMES:
            raise TraceError(
                f"{path}:{line}: unknown priority class {prio!r}; "
                f"choose one of {', '.join(CLASS_NAMES)}"
            )
        job.priority = prio
        share = _opt(row, "shareable")
        if share not in ("", "0", "1"):
            raise TraceError(f"{path}:{line}: column 'shareable' must be 0 or 1")
        if "shareable" in header:
            job.shareable = share == "1"
        jobs.append(job)
    return jobs


def _philly(path: str, header: list[str], rows: Rows) -> list[RawJob]:
    _require(path, header, PHILLY_COLUMNS, "philly")
    jobs = []
    stamps: list[float] = []
    for line, row in rows:
        text = _opt(row, "timestamp")
        try:
            stamp = datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()
        except ValueError:
            raise TraceError(
                f"{path}:{line}: column 'timestamp' is not YYYY-MM-DD HH:MM:SS: {text!r}"
            ) from None
        duration = _nonneg(path, line, "duration", row.get("duration"))
        if duration <= 0:
            raise TraceError(f"{path}:{line}: column 'duration' must be > 0")
        stamps.append(stamp)
        jobs.append(
            RawJob(
                name=str(line - 1),
                line=line,
                submit=0.0,
                gpus=_count(path, line, "num_gpus", row.get("num_gpus")),
                duration=duration,
                group=_opt(row, "cluster"),
                shareable=False,  # no workload: replays exclusive
            )
        )
    origin = min(stamps, default=0.0)
    for job, stamp in zip(jobs, stamps, strict=True):
        job.submit = stamp - origin
    return jobs


def _gavel(path: str, header: list[str], rows: Rows) -> list[RawJob]:
    _require(path, header, GAVEL_COLUMNS, "gavel")
    jobs = []
    for line, row in rows:
        workload = _opt(row, "job_type")
        if not workload:
            raise TraceError(f"{path}:{line}: column 'job_type' is empty")
        jobs.append(
            RawJob(
                name=str(line - 1),
                line=line,
                submit=_nonneg(path, line, "arrival_time_s", row.get("arrival_time_s")),
                gpus=_count(path, line, "scale_factor", row.get("scale_factor")),
                workload=workload,
                steps=_nonneg(path, line, "total_steps", row.get("total_steps")),
                group=_opt(row, "vc"),
            )
        )
    return jobs


# ------------------------------------------------------------------ throughputs

Throughputs = dict[tuple[str, str, int], float]


def read_throughputs(path: str) -> tuple[Throughputs, str]:
    """Solo steps/s per (worker_type lower-cased, job_type, GPU count); a throughput
    of 0 is left out (missing). Returns the table and the column used."""
    header, rows = _open_rows(path)
    _require(path, header, ("worker_type", "job_type", "scale_factor"), "throughputs")
    if THROUGHPUT_COLUMN in header:
        column = THROUGHPUT_COLUMN
    elif THROUGHPUT_FALLBACK_COLUMN in header:
        column = THROUGHPUT_FALLBACK_COLUMN
    else:
        rows.close()
        raise TraceError(
            f"{path}:1: throughput table is missing column {THROUGHPUT_COLUMN}"
        )
    table: Throughputs = {}
    for line, row in rows:
        value = _nonneg(path, line, column, row.get(column))
        scale = _count(path, line, "scale_factor", row.get("scale_factor"))
        if value > 0:
            key = (_opt(row, "worker_type").lower(), _opt(row, "job_type"), scale)
            table[key] = value
    return table, column


def throughput(
    table: Throughputs, model: str, workload: str, gpus: int, *, consolidated: bool
) -> float | None:
    """Steps/s of ``workload`` on ``gpus`` GPUs of ``model`` (one node or spread)."""
    worker = model.lower() if consolidated else f"{model.lower()}_unconsolidated"
    return table.get((worker, workload, gpus))


def reference_duration(
    table: Throughputs,
    nodes: Sequence[NodeSpec],
    workload: str,
    gpus: int,
    steps: float,
) -> float | None:
    """The solo duration on the cluster's first model (in spec order) that has a
    throughput: consolidated rows when the job fits one node of that model."""
    biggest: dict[str, int] = {}
    for node in nodes:
        biggest[node.model] = max(biggest.get(node.model, 0), node.gpus)
    for model, size in biggest.items():
        rate = throughput(table, model, workload, gpus, consolidated=gpus <= size)
        if rate:
            return steps / rate
    return None


# ------------------------------------------------------------------ completion


def user_limit_for(duration: float, factor: float) -> float:
    """A limit as a user sets it: the smallest of 1..168 h above duration x factor,
    beyond 168 h that value rounded up to a whole day."""
    target = duration * factor
    for hours in LIMIT_STEPS_H:
        if hours * 3600.0 >= target:
            return hours * 3600.0
    return math.ceil(target / 86400.0) * 86400.0


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
    rows.sort(key=lambda r: (r.submit, r.line))
    if opts.max_jobs is not None:
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
            )
        )
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
    )
