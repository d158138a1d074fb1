"""Metrics of a finished replay: plain arithmetic over the jobs, no I/O."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from scheduler.sim.engine import SimResult
    from scheduler.sim.jobs import SimJob

SLOWDOWN_FLOOR_S = 10.0
SIZE_BUCKETS = (("1", 1, 1), ("2-4", 2, 4), ("5-8", 5, 8), ("9+", 9, 10**9))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal."""
    if not values:
        return None
    squares = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * squares) if squares else 1.0


def jct(job: SimJob) -> float:
    return job.end - job.submit


def queue_time(job: SimJob) -> float:
    """Time not running between submission and the end (all pending intervals and
    the preempted attempts' runs are not queue; queue = JCT - time run)."""
    return job.end - job.submit - job.run_total


def bounded_slowdown(job: SimJob) -> float:
    return jct(job) / max(job.ref_duration, SLOWDOWN_FLOOR_S)


def user_slowdown(job: SimJob) -> float:
    """Bounded slowdown as Jain's index over users reads it: max(1, JCT /
    max(true run time, 10 s)); the floor of 1 keeps a job that timed out before
    its true run time from counting as faster than alone."""
    return max(1.0, bounded_slowdown(job))


def colocation(result: SimResult) -> dict[str, Any]:
    """Co-location keys (see docs/policy.md, "Co-location in the simulator").

    Pairs are counted per (joiner, partner) of each shared start, exploration
    trials apart; a pair is bad when its true combined normalised throughput
    (norm_a + norm_b from the table; 0 when it does not fit) is below 1. A job's
    true slowdown is the worst 1/rate of its sharing episodes, over the jobs that
    shared."""
    pairs = [a for a in result.admissions if not a[3]]
    trials = [a for a in result.admissions if a[3]]
    bad = sum(1 for a in pairs if a[4] < 1.0)
    shared = [j for j in result.jobs if j.shared_s > 0]
    true_slow = [j.max_true_slowdown for j in shared]
    window = result.over_cap_window_s
    return {
        "shared_gpu_fraction": (
            result.shared_gpu_s / result.busy_gpu_s if result.busy_gpu_s else 0.0
        ),
        "admitted_pairs": len(pairs),
        "bad_admissions": bad,
        "bad_admission_rate": bad / len(pairs) if pairs else None,
        "exploration_trials": len(trials),
        "bad_trials": sum(1 for a in trials if a[4] < 1.0),
        "requeues": result.requeues,
        "lost_gpu_hours": (result.oom_lost_gpu_s + result.evicted_work_s) / 3600.0,
        "max_true_slowdown": max(true_slow, default=None),
        "p99_true_slowdown": percentile(true_slow, 99),
        "over_cap_beyond_window": sum(1 for j in shared if j.over_cap_s > window),
        "trial_lost_gpu_hours": (
            result.trial_lost_gpu_s + result.trial_shared_loss_gpu_s
        )
        / 3600.0,
        "trial_over_cap_s": result.trial_over_cap_s,
        "colocation": {
            "jobs_shared": len(shared),
            "oom_failures": result.oom_failures,
            "evictions": result.evictions,
            "oom_lost_gpu_hours": result.oom_lost_gpu_s / 3600.0,
            "evicted_work_gpu_hours": result.evicted_work_s / 3600.0,
            "shared_timeouts": result.shared_timeouts,
            "over_cap_jobs": sum(1 for j in shared if j.over_cap_s > 0),
            "over_cap_window_s": window,
            "avg_true_slowdown": mean(true_slow),
            "observations": result.observations,
            "shared_gpu_hours": result.shared_gpu_s / 3600.0,
            "trial_requeue_lost_gpu_hours": result.trial_lost_gpu_s / 3600.0,
            "trial_shared_loss_gpu_hours": result.trial_shared_loss_gpu_s / 3600.0,
        },
    }


def summarize(result: SimResult) -> dict[str, Any]:
    """The output keys computed from the jobs that finished."""
    done = [j for j in result.jobs if j.state == "done"]
    lost = result.lost_gpu_s - result.overhead_in_lost_gpu_s + result.overhead_gpu_s
    jcts = [jct(j) for j in done]
    queues = [queue_time(j) for j in done]
    slow = [bounded_slowdown(j) for j in done]
    by_group: dict[str, list[float]] = defaultdict(list)
    for j, s in zip(done, slow, strict=True):
        by_group[j.group].append(s)
    group_means = {g: statistics.fmean(v) for g, v in sorted(by_group.items())}
    by_user: dict[tuple[str, str], list[float]] = defaultdict(list)
    for j in done:
        by_user[(j.group, j.user)].append(user_slowdown(j))
    user_means = [statistics.fmean(v) for v in by_user.values()]
    by_user_mean = {
        f"{g}/{u}": (len(v), statistics.fmean(v)) for (g, u), v in by_user.items()
    }
    by_size: dict[str, float | None] = {}
    for name, lo, hi in SIZE_BUCKETS:
        by_size[name] = mean([jct(j) for j in done if lo <= j.gpus <= hi])
    start = min((j.submit for j in result.jobs), default=0.0)
    end = max((j.end for j in done), default=start)
    makespan = end - start
    capacity = result.total_gpus * makespan
    # Prediction: what the policy planned at the job's final start vs what it ran
    # (wall clock: a job slowed by a partner ran longer than its solo work).
    predicted = [
        (j.planned_s, j.end - j.started_at)
        for j in done
        if j.outcome == "completed" and j.pred_source != "default"
    ]
    ape = [abs(p - a) / a for p, a in predicted if a > 0]
    ratio = [p / a for p, a in predicted if a > 0]
    sources: dict[str, int] = defaultdict(int)
    for j in done:
        sources[j.pred_source] += 1
    unfinished: dict[str, int] = defaultdict(int)
    for j in result.jobs:
        if j.state != "done":
            unfinished[j.last_reason or j.state] += 1
    decide = result.decide_ms
    return {
        "jobs": len(done),
        "avg_jct_s": mean(jcts),
        "p50_jct_s": percentile(jcts, 50),
        "p99_jct_s": percentile(jcts, 99),
        "avg_queue_s": mean(queues),
        "p99_queue_s": percentile(queues, 99),
        "max_queue_s": max(queues, default=None),
        # each finished job's queue time (``queue_time``) by job id, so that two
        # replays of one trace and seed compare job by job (``bench/sim_seeds.py``'s
        # wait ratios); ids are the trace's order and the same for every policy
        "queue_s_by_job": {str(j.id): q for j, q in zip(done, queues, strict=True)},
        "makespan_s": makespan,
        "gpu_utilization": result.busy_gpu_s / capacity if capacity > 0 else 0.0,
        "avg_slowdown": mean(slow),
        "jain_fairness": jain(list(group_means.values())),
        # Jain's index over users (each case is one virtual cluster, so the group
        # index above is 1.0 for every policy): per user, the mean of
        # max(1, bounded slowdown) over the user's finished jobs
        "jain_fairness_users": jain(user_means),
        "users": len(user_means),
        # per user ("group/user"): finished jobs and the mean Jain reads, so that
        # a low index can be traced to the users who make it
        "user_slowdown": dict(sorted(by_user_mean.items())),
        # every average and percentile of JCT, queue and slowdown is over these
        "avg_jct_over": {
            "jobs": len(done),
            "which": "finished jobs: completed and timed out (a timed-out job's"
            " JCT ends at its limit); unfinished and skipped jobs are left out",
        },
        "jct_by_size": by_size,
        "preemptions": result.preemptions,
        "passes": result.passes,
        "avg_decide_ms": mean(decide),
        "p99_decide_ms": percentile(decide, 99),
        # --- beside the required keys
        "completed": sum(1 for j in done if j.outcome == "completed"),
        "timeouts": sum(1 for j in done if j.outcome == "timeout"),
        "unfinished": dict(sorted(unfinished.items())),
        "passes_by_trigger": dict(sorted(result.passes_by_trigger.items())),
        "periodic_passes_skipped": result.periodic_skipped,
        "preempted_gpu_s_lost": result.lost_gpu_s,
        "preempted_gpu_s_kept": result.kept_gpu_s,
        # what preemptions cost: the work since each victim's last checkpoint
        # (its whole attempt if it does not checkpoint) plus the restart
        # overheads paid, and its share of the GPU time jobs held
        "preemption_lost_gpu_hours": lost / 3600.0,
        "preemption_lost_share": lost / result.busy_gpu_s if result.busy_gpu_s else 0.0,
        "checkpointable_jobs": sum(1 for j in result.jobs if j.checkpointable),
        "resumes": result.resumes,
        "slowdown_by_group": group_means,
        "prediction": {
            "jobs_by_source": dict(sorted(sources.items())),
            "predicted_jobs": len(predicted),
            "mdape": percentile(ape, 50),
            "mean_predicted_over_actual": mean(ratio),
        },
        "reservations": {
            "jobs_with_est_start": result.with_est_start,
            "slipped": result.slipped,
        },
        "throughput_fallbacks": result.throughput_fallbacks,
        "jct_cdf_s": [percentile(jcts, q) for q in range(101)],
        "timeseries": {
            "t_s": [s[0] for s in result.samples],
            "pending": [s[1] for s in result.samples],
            "running": [s[2] for s in result.samples],
            "utilization": [round(s[3], 4) for s in result.samples],
        },
        "replay_wall_s": result.wall_s,
        **colocation(result),
        **pass_stats(result),
    }


def pass_stats(result: SimResult) -> dict[str, Any]:
    """The passes' ``PassStats``: mean milliseconds per stage (over the passes
    that ran it; a timing, like ``avg_decide_ms``), passes by stop reason, and the
    summed counts. Empty when the passes came from a bare decision function."""
    return {
        "stage_mean_ms": {
            stage: 1000.0 * seconds / result.stage_passes[stage]
            for stage, seconds in result.stage_s.items()
        },
        "passes_by_stop_reason": dict(sorted(result.passes_by_stop.items())),
        "pass_counts": dict(result.pass_counts),
    }
