"""Policy comparison on real traces with the trace-driven simulator.

Measures, per scenario and policy (``fifo``: strict; ``first-fit``: greedy, simulator
only; ``slurm``; ``gpulab``; ``tiresias``: 2D-LAS, simulator only, every job
checkpointable, a checkpoint every 1800 s and a 60 s restart overhead;
``tiresias-free``: the same with no preemption cost, the yardstick check that it
beats ``slurm``'s average JCT), the output of ``python -m scheduler.sim`` (JCT,
queueing, bounded slowdown, fairness over groups and over users, utilisation,
decide() cost, replay wall time, where every row of the trace went). Scenarios:

- ``a``: Philly VC 6c71a0 (9,953 jobs, 90 days) on ``16x4:p100`` (64 GPUs);
- ``b``: Gavel-Philly VC 11cb48 (steps timed with Gavel's isolated throughputs),
  ``--time-scale 0.63``, on ``8x4:p100`` (32 GPUs; offered load about 0.96);
- ``c``: the full 82k-job Philly trace on ``250x8:p100`` (2,000 GPUs), a scale test
  (run without per-pass invariant checks);
- ``d``: Philly VC 6214e9 on ``16x4:p100``, held out (never used to tune).

Co-location (policies ``gpulab-exclusive``, ``pack-by-memory``,
``gpulab``, ``oracle``; run them with ``--only colo-k80,colo-b``):

- ``colo-k80``: the tuning case, Gavel-Philly VC 11cb48, ``--time-scale 2.3`` on
  ``8x4:k80`` (offered load about 0.94);
- ``colo-b``: benchmark (b) with co-location, knobs frozen from the K80 case.

Both pass ``--assume-memory-fraction 0.45``: Gavel's traces declare no GPU memory and
the admission rule refuses a job whose need is unknown, so without it nothing
shares; 0.45 of the GPU plus the rule's 512 MiB headroom lets two jobs fit by
declaration, and whether a pair truly fits is the table's ``feasible``. The goal
line checks ``gpulab`` against ``oracle`` and the baselines.

Writes ``OUT/sim_<scenario>_<policy>.json``, ``OUT/sim_report.json`` (all summaries),
``OUT/sim_report.md`` (tables) and ``OUT/sim_report.html`` (Plotly, self-contained:
JCT CDF per policy, queue length and utilisation over time), when ``plotly`` is
installed. Exits non-zero only when it could not run at all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "datasets"
PHILLY = DATA / "philly_pollux" / "philly.csv"
GAVEL = DATA / "gavel_philly_vc_traces" / "gavel_msr_seed0.csv"
THROUGHPUTS = DATA / "gavel_colocation_throughputs" / "isolated_throughputs.csv"
COLOCATION = DATA / "gavel_colocation_throughputs" / "colocation_pairs.csv"
POLICIES = ("fifo", "first-fit", "slurm", "gpulab", "tiresias", "tiresias-free")
# report labels that are a policy run with options: label -> (policy, options)
FREE = ("--checkpoint-interval", "0", "--restart-overhead", "0")
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tiresias": ("tiresias", ("--checkpointable-fraction", "1")),
    "tiresias-free": ("tiresias", ("--checkpointable-fraction", "1", *FREE)),
}
COLO_POLICIES = ("gpulab-exclusive", "pack-by-memory", "gpulab", "oracle")
COLO_TRACE = [
    "--trace", str(GAVEL), "--vc", "11cb48", "--throughputs", str(THROUGHPUTS),
    "--colocation", str(COLOCATION), "--assume-memory-fraction", "0.45",
]  # fmt: skip

SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "a": (
        "Philly VC 6c71a0 on 16x4:p100",
        ["--trace", str(PHILLY), "--vc", "6c71a0", "--cluster", "16x4:p100"],
    ),
    "b": (
        "Gavel-Philly VC 11cb48, time-scale 0.63, on 8x4:p100",
        [
            "--trace",
            str(GAVEL),
            "--vc",
            "11cb48",
            "--time-scale",
            "0.63",
            "--cluster",
            "8x4:p100",
            "--throughputs",
            str(THROUGHPUTS),
            "--colocation",
            str(COLOCATION),
        ],
    ),
    "c": (
        "full Philly (82k jobs) on 250x8:p100 (scale test)",
        ["--trace", str(PHILLY), "--cluster", "250x8:p100", "--no-check"],
    ),
    "d": (
        "Philly VC 6214e9 on 16x4:p100 (held out)",
        ["--trace", str(PHILLY), "--vc", "6214e9", "--cluster", "16x4:p100"],
    ),
    "colo-k80": (
        "co-location tuning: Gavel-Philly VC 11cb48, time-scale 2.3, on 8x4:k80",
        [*COLO_TRACE, "--time-scale", "2.3", "--cluster", "8x4:k80"],
    ),
    "colo-b": (
        "co-location on (b): Gavel-Philly VC 11cb48, time-scale 0.63, on 8x4:p100",
        [*COLO_TRACE, "--time-scale", "0.63", "--cluster", "8x4:p100"],
    ),
}
COLO_SCENARIOS = ("colo-k80", "colo-b")

TABLE_KEYS = (
    ("jobs", "jobs", "{:.0f}"),
    ("avg_jct_s", "avg JCT (h)", "h"),
    ("p50_jct_s", "p50 JCT (h)", "h"),
    ("p99_jct_s", "p99 JCT (h)", "h"),
    ("avg_queue_s", "avg queue (h)", "h"),
    ("p99_queue_s", "p99 queue (h)", "h"),
    ("makespan_s", "makespan (d)", "d"),
    ("gpu_utilization", "util", "{:.3f}"),
    ("avg_slowdown", "avg bounded slowdown", "{:.1f}"),
    ("jain_fairness", "Jain (groups)", "{:.3f}"),
    ("jain_fairness_users", "Jain (users, mean bounded slowdown)", "{:.3f}"),
    ("completed", "completed", "{:.0f}"),
    ("timeouts", "timeouts", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("preempted_gpu_s_lost", "GPU-h lost to preemption", "h"),
    ("preemption_lost_share", "share of GPU time lost to preemption", "{:.3f}"),
    ("passes", "passes", "{:.0f}"),
    ("avg_decide_ms", "avg decide (ms)", "{:.2f}"),
    ("p99_decide_ms", "p99 decide (ms)", "{:.2f}"),
    ("replay_wall_s", "replay (s)", "{:.1f}"),
)
COLO_KEYS = (
    ("shared_gpu_fraction", "shared GPU time / busy", "{:.3f}"),
    ("admitted_pairs", "admitted pairs", "{:.0f}"),
    ("bad_admissions", "bad admissions", "{:.0f}"),
    ("bad_admission_rate", "bad admission rate", "{:.3f}"),
    ("exploration_trials", "exploration trials", "{:.0f}"),
    ("bad_trials", "bad trials", "{:.0f}"),
    ("requeues", "requeues (OOM + evictions)", "{:.0f}"),
    ("lost_gpu_hours", "lost GPU-hours", "{:.2f}"),
    ("max_true_slowdown", "max true slowdown", "{:.2f}"),
    ("p99_true_slowdown", "p99 true slowdown", "{:.2f}"),
    ("over_cap_beyond_window", "over cap beyond window", "{:.0f}"),
    ("trial_lost_gpu_hours", "GPU-hours lost to trials", "{:.2f}"),
    ("trial_over_cap_s", "job-seconds over cap in trials", "{:.0f}"),
)
COLO_DETAIL = (
    ("oom_failures", "OOM failures", "{:.0f}"),
    ("evictions", "evictions", "{:.0f}"),
    ("shared_timeouts", "timeouts after sharing", "{:.0f}"),
    ("jobs_shared", "jobs that shared", "{:.0f}"),
    ("observations", "pair observations", "{:.0f}"),
)


def fmt(value: Any, how: str) -> str:
    if value is None:
        return "-"
    if how == "h":
        return f"{value / 3600:.2f}"
    if how == "d":
        return f"{value / 86400:.1f}"
    return how.format(value)


def replay(
    scenario: str,
    policy: str,
    seed: int,
    out: Path,
    *,
    reuse: bool,
    max_jobs: int | None,
    timeout: float,
    extra: tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """One ``python -m scheduler.sim`` of a scenario into ``out``, or (``reuse``)
    the result already there for the same seed and policy; None when it failed or
    timed out (said on stdout). A fresh result carries ``process_wall_s``."""
    if reuse and out.is_file():
        try:
            kept: dict[str, Any] = json.loads(out.read_text())
        except ValueError:
            pass
        else:
            if kept.get("seed") == seed and kept.get("policy") == policy:
                sys.stdout.write(f"-- {scenario}/{policy}: reusing {out}\n")
                return kept
    cmd = [
        sys.executable, "-m", "scheduler.sim", *SCENARIOS[scenario][1],
        "--policy", policy, "--seed", str(seed), "--out", str(out), "--quiet",
        *extra,
    ]  # fmt: skip
    if max_jobs:
        cmd += ["--max-jobs", str(max_jobs)]
    sys.stdout.write(f"-- {scenario}/{policy}: {' '.join(cmd[3:])}\n")
    sys.stdout.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        sys.stdout.write(f"   timed out after {timeout:.0f} s\n")
        return None
    if proc.returncode != 0:
        sys.stdout.write(f"   failed ({proc.returncode}): {proc.stderr.strip()}\n")
        return None
    result: dict[str, Any] = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def run_one(
    scenario: str, policy: str, out_dir: Path, args: argparse.Namespace
) -> dict[str, Any] | None:
    out = out_dir / f"sim_{scenario}_{policy}.json"
    if args.report_only and not out.is_file():
        sys.stdout.write(f"-- {scenario}/{policy}: no result in {out_dir}\n")
        return None
    name, extra = VARIANTS.get(policy, (policy, ()))
    result = replay(
        scenario,
        name,
        args.seed,
        out,
        reuse=args.reuse or args.report_only,
        max_jobs=args.max_jobs,
        timeout=args.timeout,
        extra=extra,
    )
    if result is None or "process_wall_s" not in result:
        return result  # failed, or reused
    wall = result["process_wall_s"]
    sys.stdout.write(
        f"   {result['jobs']} jobs, avg JCT {result['avg_jct_s'] or 0:.0f} s, "
        f"util {result['gpu_utilization']:.3f}, load {result['offered_load']:.3f}, "
        f"skipped {result['skipped']}, read {result['read_s']:.2f} s, "
        f"replay {result['replay_wall_s']:.1f} s (wall {wall:.1f} s)\n"
    )
    return result


def goal_lines(by_policy: dict[str, dict[str, Any]]) -> list[str]:
    """The policy's goal, checked: ``gpulab`` beats ``slurm`` on average JCT without
    a worse p99 JCT, nor a size class's average JCT worse by more than 10%."""
    g, s = by_policy.get("gpulab"), by_policy.get("slurm")
    if not g or not s or not g.get("avg_jct_s") or not s.get("avg_jct_s"):
        return []

    def delta(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{(a / b - 1) * 100:+.1f}%"

    parts = [
        f"avg JCT {delta(g['avg_jct_s'], s['avg_jct_s'])}",
        f"p99 JCT {delta(g['p99_jct_s'], s['p99_jct_s'])}",
    ]
    worst = 0.0
    for bucket in ("1", "2-4", "5-8", "9+"):
        a, b = g["jct_by_size"].get(bucket), s["jct_by_size"].get(bucket)
        if a and b:
            parts.append(f"{bucket} GPU {delta(a, b)}")
            worst = max(worst, a / b - 1)
    met = (
        g["avg_jct_s"] < s["avg_jct_s"]
        and g["p99_jct_s"] <= s["p99_jct_s"]
        and worst <= 0.10
    )
    verdict = "met" if met else "NOT met"
    return [f"`gpulab` vs `slurm`: {', '.join(parts)}. Goal {verdict}."]


def yardstick_lines(by_policy: dict[str, dict[str, Any]]) -> list[str]:
    """The yardstick check: ``tiresias`` with every job checkpointable and no
    preemption cost (``tiresias-free``) must beat ``slurm``'s average JCT, or the
    simulator (or the baseline) is suspect."""
    t, s = by_policy.get("tiresias-free"), by_policy.get("slurm")
    if not t or not s or not t.get("avg_jct_s") or not s.get("avg_jct_s"):
        return []
    ok = t["avg_jct_s"] < s["avg_jct_s"]
    return [
        f"Yardstick: `tiresias-free` avg JCT {t['avg_jct_s'] / 3600:.2f} h vs"
        f" `slurm` {s['avg_jct_s'] / 3600:.2f} h"
        f" ({(t['avg_jct_s'] / s['avg_jct_s'] - 1) * 100:+.1f}%):"
        f" {'holds' if ok else 'FAILS'}."
    ]


def accounting_lines(by_policy: dict[str, dict[str, Any]]) -> list[str]:
    """Where every row of the trace went, per policy (``accounted``)."""
    lines = []
    for policy, r in by_policy.items():
        a = r.get("accounted")
        if not a:
            continue
        skipped = ", ".join(f"{k} {n}" for k, n in a["skipped"].items()) or "none"
        outside = ", ".join(f"{k} {n}" for k, n in a["outside_case"].items())
        lines.append(
            f"- `{policy}`: {a['trace_rows']} rows = {outside or 'none'} outside the"
            f" case + skipped ({skipped}) + {a['completed']} completed +"
            f" {a['timed_out']} timed out + {a['unfinished']} unfinished; averages"
            f" over the {r['avg_jct_over']['jobs']} finished jobs"
        )
    return ["Accounting:", "", *lines, ""] if lines else []


def colo_goal_lines(by_policy: dict[str, dict[str, Any]]) -> list[str]:
    """The co-location goal, checked: ``gpulab`` gets at least 75% of ``oracle``'s
    reduction in average JCT relative to ``gpulab-exclusive``, beats
    ``pack-by-memory``, with under 2% bad admissions and no job slowed beyond its
    cap for longer than the detection window."""
    g = by_policy.get("gpulab")
    x = by_policy.get("gpulab-exclusive")
    o = by_policy.get("oracle")
    p = by_policy.get("pack-by-memory")
    if not g or not x or not o or not p:
        return []
    base = x["avg_jct_s"]
    ours, ceiling = base - g["avg_jct_s"], base - o["avg_jct_s"]
    share = ours / ceiling if ceiling > 0 else None
    rate = g.get("bad_admission_rate") or 0.0
    checks = [
        (
            share is not None and share >= 0.75,
            f"{'-' if share is None else f'{share * 100:.0f}%'} of `oracle`'s avg"
            f" JCT reduction ({ours / 3600:+.2f} h of {ceiling / 3600:+.2f} h vs"
            " `gpulab-exclusive`)",
        ),
        (
            g["avg_jct_s"] < p["avg_jct_s"],
            f"avg JCT {g['avg_jct_s'] / 3600:.2f} h vs `pack-by-memory`"
            f" {p['avg_jct_s'] / 3600:.2f} h",
        ),
        (rate < 0.02, f"bad admissions {rate * 100:.1f}%"),
        (
            g.get("over_cap_beyond_window") == 0,
            f"{g.get('over_cap_beyond_window')} job(s) over cap beyond the window",
        ),
    ]
    parts = [f"{text} ({'ok' if ok else 'NO'})" for ok, text in checks]
    verdict = "met" if all(ok for ok, _ in checks) else "NOT met"
    return [
        f"`gpulab` co-location: {'; '.join(parts)}. Goal {verdict}."
        f" Exploration: {g.get('exploration_trials')} trials ({g.get('bad_trials')}"
        f" bad); lost work {g.get('lost_gpu_hours', 0):.2f} GPU-h."
    ]


def markdown(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["# Simulator: policy comparison", ""]
    for scenario, by_policy in results.items():
        if not by_policy:
            continue
        first = next(iter(by_policy.values()))
        lines += [
            f"## ({scenario}) {SCENARIOS[scenario][0]}",
            "",
            f"{first['jobs_submitted']} jobs submitted, skipped {first['skipped']}, "
            f"offered load {first['offered_load']:.3f}, "
            f"trace span {first['trace_span_s'] / 86400:.1f} d, "
            f"cluster {first['cluster']} ({first['cluster_gpus']} GPUs), "
            f"seed {first['seed']}, trace read in {first['read_s']:.2f} s.",
            "",
            "| metric | " + " | ".join(by_policy) + " |",
            "| --- | " + " | ".join("---:" for _ in by_policy) + " |",
        ]
        for key, label, how in TABLE_KEYS:
            cells = [fmt(r.get(key), how) for r in by_policy.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for bucket in ("1", "2-4", "5-8", "9+"):
            cells = [fmt(r["jct_by_size"].get(bucket), "h") for r in by_policy.values()]
            lines.append(f"| avg JCT {bucket} GPU (h) | " + " | ".join(cells) + " |")
        cells = [str(r.get("unfinished") or "-") for r in by_policy.values()]
        lines.append("| never started (last reason) | " + " | ".join(cells) + " |")
        if scenario in COLO_SCENARIOS:
            for key, label, how in COLO_KEYS:
                cells = [fmt(r.get(key), how) for r in by_policy.values()]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            for key, label, how in COLO_DETAIL:
                cells = [
                    fmt((r.get("colocation") or {}).get(key), how)
                    for r in by_policy.values()
                ]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", *goal_lines(by_policy), *colo_goal_lines(by_policy)]
        lines += ["", *yardstick_lines(by_policy), "", *accounting_lines(by_policy)]
        lines += ["", "Assumptions: " + "; ".join(first["assumptions"]), ""]
    return "\n".join(lines) + "\n"


def html(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> bool:
    try:
        import plotly.graph_objects as go
        from plotly.offline import plot
    except ImportError:
        sys.stdout.write("plotly not installed: no HTML report\n")
        return False
    parts = ["<html><head><meta charset='utf-8'><title>gpulab simulator</title>"]
    parts.append("</head><body><h1>gpulab simulator: policy comparison</h1>")
    include = True
    for scenario, by_policy in results.items():
        if not by_policy:
            continue
        parts.append(f"<h2>({scenario}) {SCENARIOS[scenario][0]}</h2>")
        cdf = go.Figure()
        queue = go.Figure()
        util = go.Figure()
        for policy, r in by_policy.items():
            xs = [v / 3600 for v in r["jct_cdf_s"] if v is not None]
            cdf.add_trace(
                go.Scatter(x=xs, y=[i / 100 for i in range(len(xs))], name=policy)
            )
            ts = [t / 86400 for t in r["timeseries"]["t_s"]]
            queue.add_trace(go.Scatter(x=ts, y=r["timeseries"]["pending"], name=policy))
            util.add_trace(
                go.Scatter(x=ts, y=r["timeseries"]["utilization"], name=policy)
            )
        cdf.update_layout(
            title="JCT CDF", xaxis_title="JCT (h, log)", xaxis_type="log",
            yaxis_title="fraction of jobs",
        )  # fmt: skip
        queue.update_layout(
            title="pending jobs", xaxis_title="days", yaxis_title="jobs"
        )
        util.update_layout(
            title="GPU utilisation", xaxis_title="days", yaxis_title="busy / all"
        )
        for fig in (cdf, queue, util):
            parts.append(
                plot(
                    fig,
                    output_type="div",
                    include_plotlyjs=include,
                    auto_open=False,
                )
            )
            include = False
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--only", default="a,b,c,d", help="scenarios, e.g. a,b")
    p.add_argument(
        "--policies",
        help=f"default: {','.join(POLICIES)}; for {', '.join(COLO_SCENARIOS)}: "
        f"{','.join(COLO_POLICIES)}",
    )
    p.add_argument("--max-jobs", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per run, s")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep results already in --out-dir (same seed) instead of re-running",
    )
    p.add_argument("--parallel", type=int, default=1, help="runs at once")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the results already in --out-dir",
    )
    args = p.parse_args(argv)
    scenarios = [s for s in args.only.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    chosen = [s for s in (args.policies or "").split(",") if s]
    known = (*POLICIES, *COLO_POLICIES, *VARIANTS)
    if unknown or any(pol not in known for pol in chosen):
        sys.stderr.write(f"sim_report: unknown scenario or policy in {args}\n")
        return 2
    if not PHILLY.is_file() or not GAVEL.is_file():
        sys.stderr.write(f"sim_report: datasets not found under {DATA}\n")
        return 1
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    pairs = [
        (sc, pol)
        for sc in scenarios
        for pol in chosen or (COLO_POLICIES if sc in COLO_SCENARIOS else POLICIES)
    ]
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        done = list(pool.map(lambda sp: run_one(sp[0], sp[1], out_dir, args), pairs))
    for (scenario, policy), r in zip(pairs, done, strict=True):
        results.setdefault(scenario, {})
        if r is not None:
            results[scenario][policy] = r
    slim = {
        s: {
            pol: {
                k: v
                for k, v in r.items()
                if k not in ("jct_cdf_s", "timeseries", "queue_s_by_job")
            }
            for pol, r in by.items()
        }
        for s, by in results.items()
    }
    (out_dir / "sim_report.json").write_text(json.dumps(slim, indent=1) + "\n")
    report = markdown(results)
    (out_dir / "sim_report.md").write_text(report)
    sys.stdout.write("\n" + report)
    if html(results, out_dir / "sim_report.html"):
        sys.stdout.write(f"wrote {out_dir / 'sim_report.html'}\n")
    sys.stdout.write(f"wrote {out_dir / 'sim_report.md'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
