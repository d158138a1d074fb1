"""Command line of the simulator.

``python -m scheduler.sim --trace F --cluster SPEC --policy P [--throughputs F]
[--colocation F] [--seed N] [--out F]`` and the options below. Bad input (trace,
spec, options; a case whose every row is skipped) exits 2 with one line naming the
problem; a decision the physics cannot apply (a policy bug) exits 3. Rows skipped
are counted on stderr. ``--policy oracle`` (simulator only) needs ``--colocation``;
``first-fit`` and ``tiresias`` are simulator-only references too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.spec import SpecError, parse_cluster_spec
from scheduler.policy import (
    BACKFILL_PLANS,
    POLICIES,
    SIM_ONLY,
    PassResult,
    PolicyConfig,
    run_pass,
)
from scheduler.policy.predict import HISTORY, PREDICTIONS
from scheduler.sim import oracle, tiresias
from scheduler.sim.colocation import NOISE_SIGMA, REPORT_S, read_colocation
from scheduler.sim.engine import (
    InvariantError,
    PolicyContractError,
    SimOptions,
    Simulator,
)
from scheduler.sim.metrics import summarize
from scheduler.sim.prepare import PrepareOptions, prepare
from scheduler.sim.progress import ASSUMPTION as PROGRESS_NOTE
from scheduler.sim.trace import FORMATS, TraceError, read_throughputs, read_trace

if TYPE_CHECKING:
    from collections.abc import Callable

    from scheduler.policy import ClusterState
    from scheduler.sim.jobs import PreparedTrace

CHECKPOINT_NOTE = (
    "a preempted job returns to the queue with its original submit time (age kept); "
    "it restarts from scratch (no checkpoint credit) unless it is checkpointable: "
    "then it keeps its work up to its last checkpoint (one per --checkpoint-interval "
    "s of progress; 0: all of it) and its next attempt first pays "
    "--restart-overhead s"
)
COLOCATION_NOTE = (
    "co-location: a sharing job progresses at its normalised co-located throughput "
    "from the table (the cluster's GPU model rows), a pair the table marks "
    "infeasible or lacks fails out of memory at start (the joiner is requeued, age "
    "kept), an evicted job loses its attempt's work; the policy sees labels, "
    f"declared memory and progress reports (one per {REPORT_S:g} s, lognormal "
    f"sigma {NOISE_SIGMA:g}), never the table"
)
SIM_POLICIES = (*POLICIES, *SIM_ONLY, oracle.NAME, tiresias.NAME)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1]: {text}")
    return value


def _nonneg(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _nonneg_or_off(text: str) -> float | None:
    """``_nonneg``, or None for "off" (a rule that is on by default)."""
    if text.strip().lower() == "off":
        return None
    return _nonneg(text)


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scheduler.sim",
        description="Replay a job trace through the scheduling policy "
        "with a virtual clock.",
    )
    p.add_argument("--trace", required=True, help="trace CSV")
    p.add_argument("--format", choices=FORMATS, default="auto")
    p.add_argument(
        "--cluster", required=True, help="e.g. 16x4:p100 or 8x4:p100+4x8:k80"
    )
    p.add_argument(
        "--policy",
        choices=SIM_POLICIES,
        default="gpulab",
        help="oracle: the co-location ceiling (reads --colocation; simulator only)",
    )
    p.add_argument(
        "--backfill-plan",
        choices=BACKFILL_PLANS,
        default=PolicyConfig.backfill_plan,
        help="gpulab: backfill plans with time limits or min(limit, prediction)",
    )
    p.add_argument(
        "--prediction",
        choices=PREDICTIONS,
        default=PolicyConfig.prediction,
        help="how a waiting job's run time is predicted: the longest of the owner's "
        "last runs, or the median of the most specific pool of similar jobs "
        "(GPULAB_PREDICTION; scheduler.policy.predict)",
    )
    p.add_argument(
        "--colo-packing",
        choices=("exclusive-first", "pack"),
        default=PolicyConfig.colo_packing,
        help="co-location: a free GPU first, or share first (GPULAB_COLO_PACKING)",
    )
    p.add_argument(
        "--colo-trial-gain-margin",
        type=_nonneg,
        default=PolicyConfig.colo_trial_gain_margin,
        help="co-location: an exploration trial's predicted gain must reach 1 + "
        "this (when above the gain margin) (GPULAB_COLO_TRIAL_GAIN_MARGIN)",
    )
    p.add_argument(
        "--colo-trial-min-odds",
        type=_fraction,
        default=PolicyConfig.colo_trial_min_odds,
        help="co-location: the least odds, learned from the pairs tried so far, "
        "that a trial's pair turns out admissible; 0: off (GPULAB_COLO_TRIAL_MIN_ODDS)",
    )
    p.add_argument(
        "--colo-trial-max-failures",
        type=int,
        default=PolicyConfig.colo_trial_max_failures,
        help="co-location: rank trials by their odds and refuse a family pair "
        "after this many failed trials with no win; 0: off "
        "(GPULAB_COLO_TRIAL_MAX_FAILURES)",
    )
    p.add_argument(
        "--colo-trial-evict-margin",
        type=_nonneg,
        default=PolicyConfig.colo_trial_evict_margin,
        help="co-location: end a trial at its first measurement over a cap by more "
        "than this fraction; unset: off (GPULAB_COLO_TRIAL_EVICT_MARGIN)",
    )
    p.add_argument(
        "--colo-evict-z",
        type=_nonneg_or_off,
        default=PolicyConfig.colo_evict_z,
        help="co-location: judge a job of a pair seen before by the pair's earlier "
        "episodes and the current one, and evict when that plus this many standard "
        "errors is over its cap (default %(default)s); off: judged by the current "
        "measurement alone (GPULAB_COLO_EVICT_Z)",
    )
    p.add_argument(
        "--colo-retrial-z",
        type=_nonneg_or_off,
        default=PolicyConfig.colo_retrial_z,
        help="co-location: try a pair seen before and refused for protection again "
        "while its record is within this many standard errors of a cap (default "
        "%(default)s; off: never) (GPULAB_COLO_RETRIAL_Z)",
    )
    p.add_argument(
        "--colo-retrial-episodes",
        type=_count,
        default=PolicyConfig.colo_retrial_episodes,
        help="co-location: re-trials only while the pair was seen in fewer episodes "
        "(GPULAB_COLO_RETRIAL_EPISODES)",
    )
    p.add_argument("--throughputs", help="solo steps/s per workload (Gavel format)")
    p.add_argument(
        "--colocation",
        help="ground-truth pairwise co-location table (Gavel colocation_pairs.csv)",
    )
    p.add_argument(
        "--assume-memory-fraction",
        type=_fraction,
        help="a shareable job the trace gives no GPU memory declares this fraction "
        "of the smallest GPU (default: none, and it cannot share)",
    )
    p.add_argument(
        "--gpu-job-limit",
        type=_count,
        default=SimOptions.gpu_job_limit,
        help="jobs a GPU may run at once (its slots)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the result JSON here (default: stdout)")
    p.add_argument("--vc", help="keep one virtual cluster (group) of the trace")
    p.add_argument("--time-scale", type=_positive, default=1.0)
    p.add_argument("--max-jobs", type=_count)
    p.add_argument("--period", type=_positive, default=60.0, help="periodic pass, s")
    p.add_argument("--no-limit-fraction", type=_fraction, default=0.5)
    p.add_argument("--best-effort-fraction", type=_fraction, default=0.0)
    p.add_argument(
        "--checkpointable-fraction",
        type=_fraction,
        default=0.0,
        help="a seeded share of jobs that checkpoint: preempted, they keep their "
        "work up to their last checkpoint",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=_nonneg,
        default=SimOptions.checkpoint_interval_s,
        help="s of progress between a checkpointable job's checkpoints (0: every "
        "moment)",
    )
    p.add_argument(
        "--restart-overhead",
        type=_nonneg,
        default=SimOptions.restart_overhead_s,
        help="s a job resumed from a checkpoint spends before it progresses",
    )
    p.add_argument(
        "--preempt-min-run",
        type=_nonneg,
        default=PolicyConfig.preempt_min_run_s,
        help="gpulab: s a checkpointable job runs before it may be preempted by "
        "attained service (GPULAB_PREEMPT_MIN_RUN)",
    )
    p.add_argument(
        "--las-threshold",
        type=_positive,
        default=PolicyConfig.las_threshold_gpu_s / 3600.0,
        help="gpulab: attained service (GPU-hours) of the lower LAS queue, whose "
        "checkpointable jobs top-queue jobs may preempt (GPULAB_LAS_THRESHOLD)",
    )
    p.add_argument(
        "--las-max-slowdown",
        type=_positive,
        default=PolicyConfig.las_max_slowdown,
        help="gpulab: a job in the system longer than this x its service time is "
        "not preempted nor held back by attained service (GPULAB_LAS_MAX_SLOWDOWN)",
    )
    p.add_argument(
        "--max-wait",
        type=_nonneg,
        default=PolicyConfig.max_wait_s,
        help="gpulab: s a batch job may wait (time not running) before it goes "
        "ahead of every job of its class and below and is no longer preempted by "
        "attained service; 0: no bound (GPULAB_MAX_WAIT)",
    )
    p.add_argument(
        "--preempted-max-wait",
        type=_nonneg,
        default=PolicyConfig.preempted_max_wait_s,
        help="gpulab: s a preempted job may wait since its preemption before it "
        "goes ahead of every job of its class and below; restarted after that "
        "long, it is not preempted by attained service again; 0: no such bound "
        "(GPULAB_PREEMPTED_MAX_WAIT)",
    )
    p.add_argument(
        "--las-extra-plans",
        type=int,
        default=PolicyConfig.las_extra_plans,
        help="gpulab: waiting jobs after the top blocked one that may each get a "
        "preemption plan by attained service per pass (GPULAB_LAS_EXTRA_PLANS)",
    )
    p.add_argument(
        "--las-victims",
        choices=("attained", "checkpoint", "remaining"),
        default=PolicyConfig.las_victims,
        help="gpulab: LAS victims tried most attained first, least work lost "
        "since their last checkpoint first, or most time left first "
        "(GPULAB_LAS_VICTIMS)",
    )
    p.add_argument(
        "--guest-backfill",
        choices=("off", "on", "predicted"),
        default=PolicyConfig.guest_backfill,
        help="gpulab: a checkpointable job that fits only on GPUs reserved for "
        "the top blocked job starts there as a guest and yields them when that "
        "job can start; 'predicted': only one whose prediction ends by the "
        "reservation (GPULAB_GUEST_BACKFILL)",
    )
    p.add_argument(
        "--las-shorter",
        action="store_true",
        help="gpulab: a LAS victim must have more time left than the waiting "
        "job is planned to run (GPULAB_LAS_SHORTER)",
    )
    p.add_argument(
        "--no-las",
        action="store_true",
        help="gpulab: no preemption by attained service (class preemption only)",
    )
    p.add_argument(
        "--oracle-runtime",
        action="store_true",
        help="experiment, simulator only: the policy's run-time inputs are the "
        "jobs' true remaining run times (pending jobs' planned run time, running "
        "jobs' ends; no progress), an upper bound of what predictions can buy",
    )
    p.add_argument(
        "--weight-runtime",
        type=_nonneg,
        default=PolicyConfig.weight_runtime,
        help="gpulab: weight of the run-time factor (GPULAB_WEIGHT_RUNTIME)",
    )
    p.add_argument(
        "--weight-fairshare",
        type=_nonneg,
        default=PolicyConfig.weight_fairshare,
        help="gpulab and slurm: weight of the fair-share factor "
        "(GPULAB_WEIGHT_FAIRSHARE)",
    )
    p.add_argument(
        "--fairshare-user",
        type=_fraction,
        default=PolicyConfig.fairshare_user,
        help="gpulab: weight of the user's part of fair share within its group, "
        "0..1 (GPULAB_FAIRSHARE_USER); 0: only groups compete (slurm: always 1)",
    )
    p.add_argument(
        "--runtime-ref",
        type=_positive,
        default=PolicyConfig.runtime_ref_s / 3600.0,
        help="gpulab: hours at which the run-time factor reaches 0 "
        "(GPULAB_RUNTIME_REF)",
    )
    p.add_argument(
        "--runtime-age",
        type=_nonneg,
        default=PolicyConfig.runtime_age_gpu_s / 3600.0,
        help="gpulab: GPU-hours of waiting after which a job has the shortest "
        "job's run-time head start (GPULAB_RUNTIME_AGE, in GPU-seconds); 0: off",
    )
    p.add_argument(
        "--runtime-age-min-gpus",
        type=_count,
        default=PolicyConfig.runtime_age_min_gpus,
        help="gpulab: only jobs of at least this many GPUs earn the head start "
        "of --runtime-age (GPULAB_RUNTIME_AGE_MIN_GPUS)",
    )
    p.add_argument(
        "--tiresias-threshold",
        type=_positive,
        default=tiresias.DEFAULT_THRESHOLD_GPU_H,
        help="tiresias: attained service (GPU-hours) that demotes a job to queue 1",
    )
    p.add_argument(
        "--tiresias-starve-limit",
        type=_positive,
        default=tiresias.DEFAULT_STARVE_LIMIT,
        help="tiresias: a queue-1 job waiting longer than this x its last run is "
        "promoted",
    )
    p.add_argument("--half-life-days", type=_positive, default=7.0)
    p.add_argument("--history-n", type=_count, default=HISTORY)
    p.add_argument("--preempt-grace", type=_nonneg, default=30.0)
    p.add_argument("--sample-min", type=_nonneg, default=60.0)
    p.add_argument("--no-check", action="store_true", help="skip per-pass invariants")
    p.add_argument(
        "--progress-fraction",
        type=_fraction,
        default=SimOptions.progress_fraction,
        help="share of jobs that report progress (sim.progress)",
    )
    p.add_argument(
        "--early-stop-fraction",
        type=_fraction,
        default=SimOptions.early_stop_fraction,
        help="share of the reporting jobs that end before their total",
    )
    p.add_argument(
        "--progress-noise",
        type=_nonneg,
        default=SimOptions.progress_noise,
        help="multiplies the progress reports' noise (2: doubled)",
    )
    p.add_argument("--quiet", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Read, replay and summarize; raises TraceError/SpecError on bad input."""
    nodes = parse_cluster_spec(args.cluster)
    t0 = time.perf_counter()
    fmt, raw = read_trace(args.trace, args.format)
    table, column = (None, None)
    if args.throughputs:
        table, column = read_throughputs(args.throughputs)
    colocation = read_colocation(args.colocation) if args.colocation else None
    if args.policy == oracle.NAME and colocation is None:
        raise TraceError("--policy oracle reads the truth: pass --colocation FILE")
    read_s = time.perf_counter() - t0
    opts = PrepareOptions(
        seed=args.seed,
        vc=args.vc,
        time_scale=args.time_scale,
        max_jobs=args.max_jobs,
        no_limit_fraction=args.no_limit_fraction,
        best_effort_fraction=args.best_effort_fraction,
        assume_memory_fraction=args.assume_memory_fraction,
        checkpointable_fraction=args.checkpointable_fraction,
    )
    prepared = prepare(fmt, raw, nodes, table, opts, colocation)
    prepare_s = time.perf_counter() - t0 - read_s
    if prepared.skipped:
        sys.stderr.write(
            f"skipped {sum(prepared.skipped.values())} of "
            f"{sum(prepared.skipped.values()) + len(prepared.jobs)} rows of the case: "
            + ", ".join(f"{k} {n}" for k, n in prepared.skipped.items())
            + "\n"
        )
    policy: tiresias.Tiresias | None = None
    pass_fn: Callable[[ClusterState], PassResult] = run_pass
    if args.policy == oracle.NAME and colocation is not None:
        pass_fn = oracle.runner(colocation, (n.model for n in nodes))
    elif args.policy == tiresias.NAME:
        policy = tiresias.runner(
            tiresias.TiresiasParams(
                threshold_gpu_s=args.tiresias_threshold * 3600.0,
                starve_limit=args.tiresias_starve_limit,
            ),
            {j.id: j for j in prepared.jobs},
        )
        pass_fn = policy.run
    sim = Simulator(
        prepared.jobs,
        nodes,
        PolicyConfig(
            name=args.policy,
            backfill_plan=args.backfill_plan,
            prediction=args.prediction,
            colo_packing=args.colo_packing,
            colo_trial_gain_margin=args.colo_trial_gain_margin,
            colo_trial_min_odds=args.colo_trial_min_odds,
            colo_trial_max_failures=args.colo_trial_max_failures,
            colo_trial_evict_margin=args.colo_trial_evict_margin,
            colo_evict_z=args.colo_evict_z,
            colo_retrial_z=args.colo_retrial_z,
            colo_retrial_episodes=args.colo_retrial_episodes,
            las_preemption=not args.no_las,
            preempt_min_run_s=args.preempt_min_run,
            las_threshold_gpu_s=args.las_threshold * 3600.0,
            las_max_slowdown=args.las_max_slowdown,
            max_wait_s=args.max_wait,
            preempted_max_wait_s=args.preempted_max_wait,
            las_extra_plans=args.las_extra_plans,
            las_victims=args.las_victims,
            las_shorter=args.las_shorter,
            guest_backfill=args.guest_backfill,
            weight_runtime=args.weight_runtime,
            weight_fairshare=args.weight_fairshare,
            fairshare_user=args.fairshare_user,
            runtime_ref_s=args.runtime_ref * 3600.0,
            runtime_age_gpu_s=args.runtime_age * 3600.0,
            runtime_age_min_gpus=args.runtime_age_min_gpus,
        ),
        SimOptions(
            period_s=args.period,
            half_life_s=args.half_life_days * 86400.0,
            history_n=args.history_n,
            preempt_grace_s=args.preempt_grace,
            sample_s=args.sample_min * 60.0,
            check=not args.no_check,
            gpu_job_limit=args.gpu_job_limit,
            seed=args.seed,
            progress_fraction=args.progress_fraction,
            early_stop_fraction=args.early_stop_fraction,
            progress_noise=args.progress_noise,
            checkpoint_interval_s=args.checkpoint_interval,
            restart_overhead_s=args.restart_overhead,
            preempt_checkpointable=args.policy == tiresias.NAME,
            oracle_runtime=args.oracle_runtime,
        ),
        throughputs=table,
        colocation=colocation,
        pass_fn=pass_fn,
    )
    result = sim.run()
    out: dict[str, Any] = summarize(result)
    out.update(sim.tracker.summary())
    if policy is not None:
        out["tiresias"] = {
            "threshold_gpu_h": args.tiresias_threshold,
            "starve_limit": args.tiresias_starve_limit,
            "promotions": policy.promotions,
        }
    out.update(
        {
            "accounted": accounted(prepared, out),
            "offered_load": prepared.offered_load,
            "skipped": prepared.skipped,
            "policy": args.policy,
            "cluster": args.cluster,
            "cluster_gpus": sim.total_gpus,
            "trace": args.trace,
            "trace_format": fmt,
            "trace_rows": prepared.read_rows,
            "jobs_submitted": len(prepared.jobs),
            "trace_span_s": prepared.span_s,
            "seed": args.seed,
            "options": {
                "vc": args.vc,
                "backfill_plan": args.backfill_plan,
                "prediction": args.prediction,
                "colo_packing": args.colo_packing,
                "colo_trial_gain_margin": args.colo_trial_gain_margin,
                "colo_trial_min_odds": args.colo_trial_min_odds,
                "colo_trial_max_failures": args.colo_trial_max_failures,
                "colo_trial_evict_margin": args.colo_trial_evict_margin,
                "colo_evict_z": args.colo_evict_z,
                "colo_retrial_z": args.colo_retrial_z,
                "colo_retrial_episodes": args.colo_retrial_episodes,
                "time_scale": args.time_scale,
                "max_jobs": args.max_jobs,
                "period_s": args.period,
                "no_limit_fraction": args.no_limit_fraction,
                "best_effort_fraction": args.best_effort_fraction,
                "half_life_days": args.half_life_days,
                "history_n": args.history_n,
                "preempt_grace_s": args.preempt_grace,
                "sample_min": args.sample_min,
                "check": not args.no_check,
                "throughputs": args.throughputs,
                "throughput_column": column,
                "colocation": args.colocation,
                "gpu_job_limit": args.gpu_job_limit,
                "assume_memory_fraction": args.assume_memory_fraction,
                "progress_fraction": args.progress_fraction,
                "early_stop_fraction": args.early_stop_fraction,
                "progress_noise": args.progress_noise,
                "checkpointable_fraction": args.checkpointable_fraction,
                "checkpoint_interval_s": args.checkpoint_interval,
                "restart_overhead_s": args.restart_overhead,
                "preempt_min_run_s": args.preempt_min_run,
                "las_preemption": not args.no_las,
                "las_threshold_gpu_h": args.las_threshold,
                "las_max_slowdown": args.las_max_slowdown,
                "max_wait_s": args.max_wait,
                "preempted_max_wait_s": args.preempted_max_wait,
                "las_extra_plans": args.las_extra_plans,
                "las_victims": args.las_victims,
                "las_shorter": args.las_shorter,
                "guest_backfill": args.guest_backfill,
                "oracle_runtime": args.oracle_runtime,
                "weight_runtime": args.weight_runtime,
                "weight_fairshare": args.weight_fairshare,
                "fairshare_user": args.fairshare_user,
                "runtime_ref_h": args.runtime_ref,
                "runtime_age_gpu_h": args.runtime_age,
                "runtime_age_min_gpus": args.runtime_age_min_gpus,
            },
            "assumptions": [
                *prepared.assumptions,
                CHECKPOINT_NOTE,
                PROGRESS_NOTE,
                *([COLOCATION_NOTE] if colocation is not None else []),
            ],
            "read_s": read_s,
            "prepare_s": prepare_s,
        }
    )
    return out


def accounted(prepared: PreparedTrace, out: dict[str, Any]) -> dict[str, Any]:
    """Where every row of the trace went: outside the case (``--vc``,
    ``--max-jobs``), skipped (by reason), completed, timed out or unfinished at
    the end (never started or still running); the counts add up to the rows."""
    unfinished = sum(out["unfinished"].values())
    got = {
        "trace_rows": prepared.read_rows,
        "outside_case": dict(prepared.outside_case),
        "skipped": dict(prepared.skipped),
        "completed": out["completed"],
        "timed_out": out["timeouts"],
        "unfinished": unfinished,
    }
    total = (
        sum(prepared.outside_case.values())
        + sum(prepared.skipped.values())
        + out["completed"]
        + out["timeouts"]
        + unfinished
    )
    if total != prepared.read_rows:
        raise InvariantError(
            f"{prepared.read_rows} rows read, {total} accounted for: {got}"
        )
    return got


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except (TraceError, SpecError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except (PolicyContractError, InvariantError) as exc:
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 3
    text = json.dumps(out, indent=1, allow_nan=False)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        sys.stdout.write(text + "\n")
    if not args.quiet:
        sys.stderr.write(
            f"{out['policy']}: {out['jobs']} jobs finished"
            f" ({out['completed']} completed, {out['timeouts']} timed out,"
            f" {out['accounted']['unfinished']} unfinished), avg JCT {out['avg_jct_s'] or 0:.0f} s, "
            f"util {out['gpu_utilization']:.3f}, load {out['offered_load']:.3f}, "
            f"{out['passes']} passes, read {out['read_s']:.2f} s, "
            f"replay {out['replay_wall_s']:.1f} s\n"
        )
    return 0
