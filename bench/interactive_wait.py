"""How long an interactive job waits for a GPU on a full demo cluster, with and
without checkpointable batch jobs: the simulator's engine and the real policy.

The cluster is ``make up``'s demo cluster (``portal.stack.up.DEFAULT_DEMO_NODES``,
``2x4:A100-80GB``, or ``--cluster``). Per seed it writes a canonical trace
(``scheduler.sim.trace``) and replays it through ``scheduler.sim`` (``prepare``
and ``Simulator``, with ``policy.run_pass``: no policy logic here):

- batch jobs keep the cluster full: a backlog of twice the cluster's GPUs at
  t=0, then arrivals at uniform times over the day bringing ``--load`` (1.2)
  times its capacity (counting only the part of their work inside the day).
  Each job's (GPUs, duration) is drawn from trace (b) of docs/benchmarks.md
  (Gavel-Philly VC 11cb48, P100 durations x 0.63; jobs of at most the
  cluster's GPUs): median 2.6 h, p90 24 h, p99 130 h. Time limits and users as
  the simulator completes them (seeded); a seeded ``fraction`` of them is
  checkpointable (the same draw per job, so the jobs checkpointable at 0.5 are
  also at 1).
- interactive jobs (class ``interactive``, 1 GPU, 2 h limit): each of
  ``--students`` (3) students works in a session for U[10, 110] min and opens
  the next one an exponential gap of mean ``--gap-min`` (20) minutes after the
  previous one ended, from t=0 to 24 h: one session at a time, as
  ``GPULAB_INTERACTIVE_MAX_PER_USER`` (1) allows. A session's end depends on
  its wait, so the submit times are settled by replaying until they agree with
  the ends (``settle``, 8-17 replays); a policy that makes students wait
  serves fewer sessions in the day.

Per policy (``gpulab``, ``slurm`` as the baseline) and checkpointable fraction
(``--fractions``, 0, 0.5, 1) over seeds ``--seeds`` (0-2): the sessions
submitted in the day, their waits (first start - submit, pooled over the seeds)
p50/p90/p99/max, the share started within 5 minutes, the batch jobs' average
JCT, preemptions (and how many were made for an interactive job), the work they
lost (GPU-hours: progress past the last checkpoint, one every 30 min of
progress, plus the 60 s restart overheads: ``SimOptions``) and the GPUs' busy
share over the day.

``python bench/interactive_wait.py [--seeds 0-2] [--fractions 0,0.5,1]
[--policies gpulab,slurm] [--max-replays 30] [--out-dir DIR]``. Writes
``DIR/trace_<seed>_<f>_<policy>.csv`` (the settled trace) and
``DIR/interactive_wait.json``, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agents.spec import SpecError, parse_cluster_spec  # noqa: E402
from portal.stack.up import DEFAULT_DEMO_NODES  # noqa: E402
from scheduler.policy import PolicyConfig, Preempt, run_pass  # noqa: E402
from scheduler.sim.engine import SimOptions, Simulator  # noqa: E402
from scheduler.sim.metrics import percentile, summarize  # noqa: E402
from scheduler.sim.prepare import PrepareOptions, prepare  # noqa: E402
from scheduler.sim.trace import (  # noqa: E402
    TraceError,
    read_throughputs,
    read_trace,
    reference_duration,
)

if TYPE_CHECKING:
    from scheduler.policy import ClusterState, PassResult
    from scheduler.sim.jobs import SimJob

DATA = ROOT.parent / "shared" / "datasets"
GAVEL = DATA / "gavel_philly_vc_traces" / "gavel_msr_seed0.csv"
THROUGHPUTS = DATA / "gavel_colocation_throughputs" / "isolated_throughputs.csv"
# trace (b) of docs/benchmarks.md: the batch jobs' sizes and lengths
B_VC, B_TIME_SCALE, B_CLUSTER = "11cb48", 0.63, "8x4:p100"
DAY_S = 86400.0
INTERACTIVE_LIMIT_S = 7200.0
SESSION_MIN_S, SESSION_MAX_S = 600.0, 6600.0
FAST_S = 300.0  # "started within 5 minutes"


def batch_pool(max_gpus: int) -> list[tuple[int, float]]:
    """(GPUs, duration s) of trace (b)'s jobs that fit ``max_gpus``."""
    _, raw = read_trace(str(GAVEL), "gavel")
    table, _ = read_throughputs(str(THROUGHPUTS))
    nodes = parse_cluster_spec(B_CLUSTER)
    pool = []
    for r in raw:
        if r.group != B_VC or r.gpus > max_gpus or r.steps is None:
            continue
        ref = reference_duration(table, nodes, r.workload, r.gpus, r.steps)
        if ref:
            pool.append((r.gpus, ref * B_TIME_SCALE))
    if not pool:
        raise TraceError(f"{GAVEL}: no job of VC {B_VC} fits {max_gpus} GPUs")
    return pool


Row = dict[str, Any]
# per student: (gap before the session, its length) in order; the first gap is
# from t=0
Plans = dict[str, list[tuple[float, float]]]


def batch_rows(
    seed: int,
    fraction: float,
    pool: list[tuple[int, float]],
    total_gpus: int,
    args: argparse.Namespace,
) -> list[Row]:
    """The seed's batch jobs (the same for every fraction and policy);
    ``fraction`` only decides which are checkpointable (one draw per job)."""
    rng = random.Random(f"interactive-wait/{seed}")
    rows: list[Row] = []

    def batch(submit: float) -> int:
        gpus, duration = rng.choice(pool)
        ckpt = rng.random() < fraction
        rows.append(
            {
                "job_id": f"b{len(rows)}",
                "submit_time": f"{submit:.1f}",
                "num_gpus": gpus,
                "duration": f"{duration:.1f}",
                "user": f"batch-u{rng.randint(1, args.batch_users)}",
                "group": "batch",
                "priority": "",
                "time_limit": "",
                "checkpointable": int(ckpt),
            }
        )
        return gpus

    backlog = 0
    while backlog < 2 * total_gpus:
        backlog += batch(0.0)
    # arrivals over the day until the work they bring inside it (GPUs x the part
    # of their duration before 24 h) is ``load`` times the day's capacity: the
    # trace's heavy tail would otherwise leave most days short of it
    brought, goal = 0.0, args.load * total_gpus * DAY_S
    while brought < goal:
        t = rng.uniform(0.0, DAY_S)
        gpus = batch(t)
        brought += gpus * min(float(rows[-1]["duration"]), DAY_S - t)
    return rows


def student_plans(seed: int, args: argparse.Namespace) -> Plans:
    """Each student's sessions: exponential gaps of mean ``gap_min``, lengths
    U[10, 110] min; enough of them to fill the day with no wait at all."""
    plans: Plans = {}
    for s in range(1, args.students + 1):
        srng = random.Random(f"interactive-wait/{seed}/student{s}")
        plan, t = [], 0.0
        while t < DAY_S:
            gap = srng.expovariate(1.0 / (args.gap_min * 60.0))
            length = srng.uniform(SESSION_MIN_S, SESSION_MAX_S)
            plan.append((gap, length))
            t += gap + length
        plans[f"student{s}"] = plan
    return plans


def open_loop(plans: Plans) -> dict[str, list[float]]:
    """Submit times as if no session waited: each gap after the last one's
    planned end."""
    out: dict[str, list[float]] = {}
    for user, plan in plans.items():
        t, times = 0.0, []
        for gap, length in plan:
            times.append(t + gap)
            t += gap + length
        out[user] = times
    return out


def session_rows(plans: Plans, submits: dict[str, list[float]]) -> list[Row]:
    """The sessions submitted within the day (class ``interactive``, 1 GPU, 2 h
    limit, never checkpointable); job ids ``<user>-<index>``."""
    rows = []
    for user, plan in plans.items():
        for k, ((_, length), t) in enumerate(zip(plan, submits[user], strict=True)):
            if t >= DAY_S:
                break
            rows.append(
                {
                    "job_id": f"{user}-{k}",
                    "submit_time": f"{t:.1f}",
                    "num_gpus": 1,
                    "duration": f"{length:.1f}",
                    "user": user,
                    "group": "students",
                    "priority": "interactive",
                    "time_limit": f"{INTERACTIVE_LIMIT_S:.0f}",
                    "checkpointable": 0,
                }
            )
    return rows


def write_trace(path: Path, rows: list[Row]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def closed_loop(
    plans: Plans, submits: dict[str, list[float]], ends: dict[str, float]
) -> dict[str, list[float]]:
    """The next submit times: a student opens session k its gap after session
    k-1 truly ended (``ends`` by job id; one not in the day pushes the rest past
    it). A wait never shortens a session, so this is never earlier."""
    out: dict[str, list[float]] = {}
    for user, plan in plans.items():
        times = [submits[user][0]]
        for k in range(1, len(plan)):
            prev = ends.get(f"{user}-{k - 1}", math.inf)
            times.append(max(submits[user][k], prev + plan[k][0]))
        out[user] = times
    return out


def replay(
    trace: Path, cluster: str, policy: str, seed: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """One replay through the simulator: its figures, and the interactive
    jobs' ends by job id."""
    nodes = parse_cluster_spec(cluster)
    fmt, raw = read_trace(str(trace), "canonical")
    prepared = prepare(fmt, raw, nodes, None, PrepareOptions(seed=seed))
    interactive_ids = {j.id for j in prepared.jobs if j.priority_class == "interactive"}
    for_interactive = 0

    def counted_pass(state: ClusterState) -> PassResult:
        """The policy's pass, unchanged; counts the preemptions the engine
        applies (a victim not already stopping, once) made for an interactive
        job: the rest are by attained service among batch jobs."""
        nonlocal for_interactive
        got = run_pass(state)
        stopping = {r.id for r in state.running if r.stopping}
        for d in got.decisions:
            if isinstance(d, Preempt) and d.victim_id not in stopping:
                stopping.add(d.victim_id)
                for_interactive += d.for_job_id in interactive_ids
        return got

    sim = Simulator(
        prepared.jobs,
        nodes,
        PolicyConfig(name=policy),
        SimOptions(seed=seed, sample_s=600.0),
        pass_fn=counted_pass,
    )
    t0 = time.perf_counter()
    result = sim.run()
    wall = time.perf_counter() - t0
    inter = [j for j in result.jobs if j.priority_class == "interactive"]
    batch = [j for j in result.jobs if j.priority_class != "interactive"]
    # the replay runs until every job has ended: one never started is a bug
    waits = [
        (j.first_start if j.first_start is not None else math.inf) - j.submit
        for j in inter
    ]
    if math.inf in waits:
        raise RuntimeError(f"{trace}: an interactive job never started ({policy})")
    jcts = [j.end - j.submit for j in batch if j.state == "done"]
    day = [s for s in result.samples if s[0] < DAY_S]
    return {
        "policy": policy,
        "seed": seed,
        "interactive_jobs": len(inter),
        "interactive_waits_s": waits,
        "interactive_preempted": sum(j.preemptions for j in inter),
        "batch_jobs": len(batch),
        "batch_checkpointable": sum(j.checkpointable for j in batch),
        "batch_unfinished": len(batch) - len(jcts),
        "batch_avg_jct_s": statistics.fmean(jcts) if jcts else None,
        "preemptions": result.preemptions,
        "preemptions_for_interactive": for_interactive,
        # sessions submitted while the same student's previous one had not
        # ended: the portal would refuse them (GPULAB_INTERACTIVE_MAX_PER_USER)
        "sessions_over_cap": over_cap(inter),
        # the simulator's own figure: preempted work past the last checkpoint,
        # plus the restart overheads paid
        "lost_gpu_h": summarize(result)["preemption_lost_gpu_hours"],
        "kept_gpu_h": result.kept_gpu_s / 3600.0,
        "busy_day": statistics.fmean(s[3] for s in day) if day else None,
        "replay_wall_s": wall,
    }, {j.name: j.end for j in inter}


def over_cap(inter: list[SimJob]) -> int:
    """Sessions submitted before the same user's previous session ended."""
    count = 0
    last_end: dict[str, float] = {}
    for j in sorted(inter, key=lambda j: j.submit):
        if j.submit < last_end.get(j.user, -math.inf):
            count += 1
        last_end[j.user] = max(last_end.get(j.user, -math.inf), j.end)
    return count


def settle(
    out: Path,
    seed: int,
    fraction: float,
    policy: str,
    batch: list[Row],
    plans: Plans,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Replay until the students' submit times agree with the replay's session
    ends (``closed_loop``): each student has one session at a time, as
    ``GPULAB_INTERACTIVE_MAX_PER_USER`` (1) makes them. Submit times only move
    later, so this stops; ``--max-replays`` bounds it and the figures say how
    many sessions still overlap their predecessor."""
    submits = open_loop(plans)
    trace = out / f"trace_{seed}_{fraction:g}_{policy}.csv"
    wall = 0.0
    for i in range(1, args.max_replays + 1):
        write_trace(trace, batch + session_rows(plans, submits))
        run, ends = replay(trace, args.cluster, policy, seed)
        wall += run["replay_wall_s"]
        nxt = closed_loop(plans, submits, ends)
        if all(
            abs(a - b) < 1.0 or (a >= DAY_S and b >= DAY_S)
            for u in plans
            for a, b in zip(nxt[u], submits[u], strict=True)
        ):
            break
        submits = nxt
    run.update(fraction=fraction, iterations=i, replay_wall_s=wall)
    return run


def _minutes(value: float | None) -> str:
    if value is None:
        return "-"
    return "never" if math.isinf(value) else f"{value / 60:.1f}"


def table(runs: list[dict[str, Any]], fractions: list[float]) -> str:
    lines = [
        "| policy | checkpointable | interactive jobs | wait p50 / p90 / p99 / max"
        " (min) | started < 5 min | batch avg JCT (h) | preemptions (for"
        " interactive) | lost work (GPU-h) | GPUs busy (day) | sessions over cap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in dict.fromkeys(r["policy"] for r in runs):
        for f in fractions:
            mine = [r for r in runs if r["policy"] == policy and r["fraction"] == f]
            if not mine:
                continue
            waits = [w for r in mine for w in r["interactive_waits_s"]]
            qs = (
                " / ".join(_minutes(percentile(waits, q)) for q in (50, 90, 99))
                + f" / {_minutes(max(waits))}"
            )
            fast = sum(w <= FAST_S for w in waits) / len(waits)
            jct = statistics.fmean(r["batch_avg_jct_s"] or 0.0 for r in mine)
            pre = statistics.fmean(r["preemptions"] for r in mine)
            pre_i = statistics.fmean(r["preemptions_for_interactive"] for r in mine)
            cap = sum(r["sessions_over_cap"] for r in mine)
            lost = statistics.fmean(r["lost_gpu_h"] for r in mine)
            busy = statistics.fmean(r["busy_day"] or 0.0 for r in mine)
            lines.append(
                f"| {policy} | {f:g} | {len(waits)} | {qs} | {fast:.0%} |"
                f" {jct / 3600:.2f} | {pre:.1f} ({pre_i:.1f}) | {lost:.1f} |"
                f" {busy:.2f} | {cap} |"
            )
    return "\n".join(lines)


def parse_seeds(text: str) -> list[int]:
    lo, dash, hi = text.partition("-")
    try:
        seeds = list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
    except ValueError:
        raise ValueError(f"--seeds: {text!r} is not a seed or a range a-b") from None
    if not seeds or seeds[0] < 0:
        raise ValueError(f"--seeds: {text!r} is not a range of seeds >= 0")
    return seeds


def parse_fractions(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--fractions: {text!r} is not a list of numbers") from None
    if not out or any(not 0.0 <= f <= 1.0 for f in out):
        raise ValueError(f"--fractions: {text!r}: each must be in [0, 1]")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default=DEFAULT_DEMO_NODES)
    p.add_argument("--seeds", default="0-2")
    p.add_argument("--fractions", default="0,0.5,1")
    p.add_argument("--policies", default="gpulab,slurm")
    p.add_argument("--load", type=float, default=1.2)
    p.add_argument("--students", type=int, default=3)
    p.add_argument("--gap-min", type=float, default=20.0)
    p.add_argument("--batch-users", type=int, default=6)
    p.add_argument("--max-replays", type=int, default=30)
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
        fractions = parse_fractions(args.fractions)
        nodes = parse_cluster_spec(args.cluster)
        if args.load <= 0 or args.students < 1 or args.gap_min <= 0:
            raise ValueError("--load, --students and --gap-min must be > 0")
        if args.max_replays < 1:
            raise ValueError("--max-replays must be >= 1")
        if args.batch_users < 1:
            raise ValueError("--batch-users must be >= 1")
        policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        unknown = [x for x in policies if x not in ("gpulab", "slurm", "fifo")]
        if unknown or not policies:
            raise ValueError(
                f"--policies: {', '.join(unknown) or 'none'}: choose among "
                "gpulab, slurm, fifo"
            )
        pool = batch_pool(sum(n.gpus for n in nodes))
    except (ValueError, SpecError, TraceError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="interactive_wait_"))
    out.mkdir(parents=True, exist_ok=True)
    total_gpus = sum(n.gpus for n in nodes)
    runs = []
    for seed in seeds:
        plans = student_plans(seed, args)
        for f in fractions:
            batch = batch_rows(seed, f, pool, total_gpus, args)
            for policy in policies:
                run = settle(out, seed, f, policy, batch, plans, args)
                runs.append(run)
                sys.stderr.write(
                    f"seed {seed} fraction {f:g} {policy}: "
                    f"{run['interactive_jobs']} interactive, "
                    f"{run['batch_jobs']} batch, {run['iterations']} replays, "
                    f"{run['replay_wall_s']:.1f} s\n"
                )
    md = table(runs, fractions)
    load = Path("/proc/loadavg").read_text().strip()
    head = (
        f"cluster {args.cluster}, seeds {args.seeds}, load {args.load:g}, "
        f"{args.students} students (gap {args.gap_min:g} min), "
        f"{os.cpu_count()} CPUs, loadavg {load}"
    )
    (out / "interactive_wait.json").write_text(
        json.dumps(
            {"header": head, "runs": runs},
            indent=1,
            allow_nan=False,
        )
        + "\n",
        encoding="utf-8",
    )
    sys.stdout.write(f"{head}\n\n{md}\n\nwritten to {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
