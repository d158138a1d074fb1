"""Trace readers: the canonical CSV, Philly (Pollux's ``philly.csv``) and Gavel's
Philly-VC traces, and the solo-throughput table of workload traces.

Everything here is pure Python (``csv``, no Django). A reader returns ``RawJob`` rows;
``prepare.prepare`` filters, scales, times and completes them into ``SimJob`` objects
that the engine replays. Bad input raises ``TraceError`` naming the file and line.
"""

from __future__ import annotations

import csv
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from scheduler.policy import DEFAULT_CLASSES
from scheduler.sim.jobs import RawJob

if TYPE_CHECKING:
    from collections.abc import Generator, Sequence

    from agents.spec import NodeSpec

CANONICAL_REQUIRED = ("job_id", "submit_time", "num_gpus")
PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "cluster")
GAVEL_COLUMNS = ("vc", "job_type", "total_steps", "arrival_time_s", "scale_factor")
THROUGHPUT_COLUMN = "isolated_steps_per_sec_simulation_json"
THROUGHPUT_FALLBACK_COLUMN = "isolated_steps_per_sec_physical_json"
FORMATS = ("auto", "canonical", "philly", "gavel")
CLASS_NAMES = tuple(DEFAULT_CLASSES)
DEFAULT_CLASS = "normal"
DEFAULT_GROUP = "default"


Rows: TypeAlias = "Generator[tuple[int, dict[str, str | None]], None, None]"


class TraceError(ValueError):
    """A trace or table the simulator cannot read; the message names file and line."""


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
        ckpt = _opt(row, "checkpointable")
        if ckpt not in ("", "0", "1"):
            raise TraceError(f"{path}:{line}: column 'checkpointable' must be 0 or 1")
        if ckpt:
            job.checkpointable = ckpt == "1"
        every = _opt(row, "checkpoint_interval_s")
        if every:
            job.checkpoint_interval_s = _nonneg(
                path, line, "checkpoint_interval_s", every
            )
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
