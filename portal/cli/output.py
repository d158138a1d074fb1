"""What the commands print: plain, fixed-width text (``grep`` and ``awk`` read it
as well as people do; ``--json`` is the stable form for programs), times in the
terminal's local zone, durations as ``squeue`` writes them. Text users gave is
printed through ``agents.jobtext.for_terminal``: a bidirectional control or an
escape sequence shows as ``⟨U+202E⟩`` instead of acting on the terminal."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from agents.jobtext import for_terminal

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

TERMINAL = frozenset({"completed", "failed", "cancelled", "timeout"})
WAITING = frozenset({"pending", "held"})


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False)


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value)


def clock(value: str | None) -> str:
    """An API timestamp in the local zone, to the second; '-' for none."""
    at = parse_time(value)
    return at.astimezone().strftime("%Y-%m-%d %H:%M:%S") if at else "-"


def hms(seconds: float | None) -> str:
    """``squeue``'s TIME: ``M:SS``, ``H:MM:SS``, ``D-HH:MM:SS``; '-' for none."""
    if seconds is None:
        return "-"
    total = max(0, int(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def elapsed(job: Mapping[str, Any], now: datetime | None = None) -> float | None:
    """How long the job has run (to its end, or to now while it runs)."""
    started = parse_time(job.get("started_at"))
    if started is None:
        return None
    end = parse_time(job.get("finished_at")) or now or datetime.now(UTC)
    return (end - started).total_seconds()


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart; the last one is not padded."""
    body = [[for_terminal(str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for row in body:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in [list(headers), *body]:
        cells = [c.ljust(widths[i]) for i, c in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def array_label(job: Mapping[str, Any]) -> str:
    if job.get("array") is None:
        return "-"
    return f"a{job['array']}[{job.get('array_index')}]"


def where(job: Mapping[str, Any]) -> str:
    """``squeue``'s NODELIST(REASON): the nodes it runs on (and the job it is being
    preempted for), or why it waits."""
    state = job.get("state", "")
    if state in WAITING:
        reason = job.get("reason") or state
        return f"({reason})"
    nodes = job.get("nodes") or []
    if nodes:
        victim = job.get("preempted_for")
        return ",".join(nodes) + (f" (preempted for {victim})" if victim else "")
    if state in TERMINAL and job.get("end_reason"):
        return f"({job['end_reason']})"
    return "-"


JOB_HEADERS = (
    "JOBID",
    "ARRAY",
    "NAME",
    "USER",
    "STATE",
    "CLASS",
    "GPUS",
    "TIME",
    "LIMIT",
    "NODES(REASON)",
)


def jobs_table(jobs: Sequence[Mapping[str, Any]], now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    rows = [
        (
            str(j["id"]),
            array_label(j),
            _cut(j.get("name", ""), 24),
            j.get("owner", ""),
            j.get("state", ""),
            j.get("priority_class", ""),
            str(j.get("gpus", "")),
            hms(elapsed(j, now)),
            hms(j.get("time_limit_s")),
            _cut(where(j), 60),
        )
        for j in jobs
    ]
    return table(JOB_HEADERS, rows)


def _cut(text: str, width: int) -> str:
    text = " ".join(str(text).split())  # one line
    return text if len(text) <= width else text[: width - 1] + "…"


def mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:.1f}G" if value >= 1024 else f"{value:.0f}M"


def checkpoint_summary(job: Mapping[str, Any]) -> str:
    """ "resumed 2 times, 14 min of work lost": the job page's words, from the
    API's ``restarts`` and ``lost_work_gpu_s`` (minutes on its GPUs)."""
    resumed = int(job.get("restarts") or 0)
    gpus = max(1, int(job.get("gpus") or 1))
    minutes = round(int(job.get("lost_work_gpu_s") or 0) / gpus / 60)
    times = "1 time" if resumed == 1 else f"{resumed} times"
    return f"resumed {times}, {minutes} min of work lost"


def job_detail(job: Mapping[str, Any]) -> str:
    """``gpulab show ID``: every field a person asks about, one per line."""
    state = job["state"]
    if state in WAITING and job.get("reason"):
        state += f" ({job['reason']})"
    if job.get("cancel_requested") and state not in TERMINAL:
        state += ", cancel requested"
    lines: list[tuple[str, str]] = [
        ("Job", f"{job['id']}  {job['name']}"),
        ("Owner", f"{job['owner']} (group {job['group']})"),
        ("State", state),
    ]
    if job.get("reason_message"):
        lines.append(("Why", job["reason_message"]))
    if job.get("queue_position") is not None:
        lines.append(("Queue position", str(job["queue_position"])))
    if job.get("est_start"):
        lines.append(("Expected start", clock(job["est_start"])))
    if job.get("held_by"):
        lines.append(("Held by", job["held_by"]))
    if job.get("array") is not None:
        lines.append(("Array", f"a{job['array']}, task {job['array_index']}"))
    deps = job.get("dependencies") or []
    if deps:
        lines.append(
            (
                "After",
                ", ".join(f"{d['type']}:{d['job']} ({d['state']})" for d in deps),
            )
        )
    gpus = str(job["gpus"])
    if job.get("gpu_model"):
        gpus += f" x {job['gpu_model']}"
    if job.get("gpu_memory_mib"):
        gpus += f", {mib(job['gpu_memory_mib'])} each"
    gpus += ", may share a GPU" if job.get("shareable") else ", exclusive"
    cap = job.get("slowdown_cap")
    lines += [
        ("Class", job.get("priority_class", "")),
        ("GPUs", gpus),
        ("Slowdown cap", "the class's" if cap is None else f"{cap:g}x"),
        (
            "If GPU partner suffers",
            "requeued" if job.get("evictable", True) else "kept running",
        ),
        ("Time limit", hms(job.get("time_limit_s"))),
    ]
    # A checkpointable job has two graces: the stop grace (cancel, time limit)
    # and the checkpoint grace (preemption); each line says which it is for.
    if job.get("kill_grace_s") is not None:
        when = " when cancelled or at its limit" if job.get("checkpointable") else ""
        lines.append(
            ("Stop grace", f"{job['kill_grace_s']}s (SIGTERM, then SIGKILL){when}")
        )
    if job.get("checkpointable"):
        lines.append(
            (
                "Checkpointable",
                f"when preempted SIG{job.get('checkpoint_signal', 'TERM')}, then"
                f" SIGKILL after {job.get('checkpoint_grace_s', 60)}s; "
                + checkpoint_summary(job),
            )
        )
    if job.get("guest"):
        lines.append(
            (
                "Guest",
                "started ahead of its turn on GPUs held for the first job waiting;"
                " stopped (work kept to its last checkpoint) and requeued when that"
                " job can start",
            )
        )
    lines.append(
        (
            "If node lost",
            "requeued" if job.get("requeue_on_node_loss", True) else "failed",
        )
    )
    if job.get("predicted_runtime_s"):
        lines.append(("Predicted run time", hms(job["predicted_runtime_s"])))
    lines += [
        ("Submitted", clock(job.get("submitted_at"))),
        ("Started", clock(job.get("started_at"))),
        ("Finished", clock(job.get("finished_at"))),
        ("Run time", hms(elapsed(job))),
        ("Attempts", str(job.get("attempts", 0))),
        ("Nodes", ",".join(job.get("nodes") or []) or "-"),
    ]
    if job.get("exit_code") is not None:
        lines.append(("Exit code", str(job["exit_code"])))
    if job.get("end_reason"):
        lines.append(("End", job["end_reason"]))
    if job.get("workload"):
        lines.append(("Workload", job["workload"]))
    lines += [("Workdir", job.get("workdir") or "-"), ("Command", job["command"])]
    for key, value in sorted((job.get("env") or {}).items()):
        lines.append(("Env", f"{key}={value}"))
    width = max(len(k) for k, _ in lines) + 1
    return "\n".join(
        f"{(k + ':').ljust(width)} {for_terminal(str(v))}" for k, v in lines
    )


def array_detail(array: Mapping[str, Any]) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in sorted(array["counts"].items()))
    limit = array.get("max_running")
    head = [
        f"Array:   a{array['id']}  {for_terminal(str(array['name']))}",
        f"Owner:   {array['owner']}",
        f"Tasks:   {array['size']} [{array['spec']}]"
        + (f", at most {limit} at once" if limit else ""),
        f"States:  {counts or '-'}",
        f"Created: {clock(array.get('created_at'))}",
        "",
    ]
    rows = [
        (
            str(t["index"]),
            str(t["id"]),
            t["state"],
            t.get("reason") or "-",
            "-" if t.get("exit_code") is None else str(t["exit_code"]),
        )
        for t in array["tasks"]
    ]
    return "\n".join(head) + table(("INDEX", "JOBID", "STATE", "REASON", "EXIT"), rows)


def usage_report(usage: Mapping[str, Any]) -> str:
    lines = [
        f"Usage of {usage['scope']}, {usage['first']} to {usage['last']} (UTC days)",
        f"  GPU-hours:  {usage['gpu_hours']:.2f}"
        + (
            f" (of which {usage['running_gpu_hours']:.2f} by running jobs)"
            if usage.get("running_gpu_hours")
            else ""
        ),
    ]
    if usage.get("lost_gpu_hours"):
        lines.append(
            f"  Lost:       {usage['lost_gpu_hours']:.2f} GPU-hours to preemption"
            " (charged to nobody)"
        )
    if usage.get("energy_kwh") is not None:
        lines.append(f"  Energy:     {usage['energy_kwh']:.2f} kWh")
    if usage.get("efficiency") is not None:
        lines.append(
            f"  Efficiency: {usage['efficiency']:.0f}% of the GPU time was busy"
        )
    quotas = usage.get("quotas") or []
    lines.append("")
    if quotas:
        rows = [
            (
                q["scope"],
                "hard" if q["hard"] else "soft",
                q["period"],
                "-"
                if q.get("gpu_hours") is None
                else f"{q['used_gpu_hours']:.1f} of {q['gpu_hours']:.1f}"
                f" ({q['percent']:.0f}%)",
                "-"
                if q.get("max_gpus") is None
                else f"{q['running_gpus']} of {q['max_gpus']}",
                clock(q.get("period_end")),
                "exhausted" if q.get("exhausted") else "",
            )
            for q in quotas
        ]
        lines.append(
            table(
                ("QUOTA", "KIND", "PERIOD", "GPU-HOURS", "GPUS", "RESETS", ""),
                rows,
            )
        )
    else:
        lines.append("No quota applies.")
    top = usage.get("top_jobs") or []
    if top:
        lines += [
            "",
            table(
                ("JOBID", "NAME", "GPU-HOURS"),
                [
                    (
                        str(t["job"]),
                        _cut(t.get("name", ""), 40),
                        f"{t['gpu_hours']:.2f}",
                    )
                    for t in top
                ],
            ),
        ]
    return "\n".join(lines)
