"""What a replay is given (``SimOptions``) and what it records (``SimResult``,
which ``metrics.summarize`` turns into the output keys), and the two errors a
replay stops on."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.policy import DEFAULT_CLASSES
from scheduler.policy.predict import HISTORY

if TYPE_CHECKING:
    from scheduler.policy import PassStats
    from scheduler.sim.jobs import SimJob

# the classes the replay runs with: the ones gpulab ships
CLASSES = DEFAULT_CLASSES


class PolicyContractError(RuntimeError):
    """``decide`` returned a decision the physics cannot apply (a policy bug)."""


class InvariantError(AssertionError):
    """A simulator invariant failed (a simulator bug)."""


@dataclass
class SimOptions:
    period_s: float = 60.0
    half_life_s: float = 7 * 86400.0
    history_n: int = HISTORY  # the production rule reads this many
    preempt_grace_s: float = 30.0
    sample_s: float = 3600.0
    check: bool = True
    gpu_job_limit: int = 2  # slots per GPU (GPULAB_GPU_JOB_LIMIT)
    oom_after_s: float = 5.0  # a job that cannot fit beside its partner fails then
    seed: int = 0  # draws the progress reports' noise
    # the progress model (``sim.progress``): who reports, who stops early, noise
    progress_fraction: float = 0.5
    early_stop_fraction: float = 0.2
    progress_noise: float = 1.0
    # Preemption cost of a checkpointable job: it keeps its work up to its last
    # checkpoint (one every ``checkpoint_interval_s`` of progress; 0: every
    # moment is checkpointed) and pays ``restart_overhead_s`` when it resumes.
    checkpoint_interval_s: float = 1800.0
    restart_overhead_s: float = 60.0
    # the policy may preempt any running job, whatever its class
    preempt_any: bool = False
    # the policy may preempt any checkpointable job, whatever its class (tiresias:
    # a job that cannot checkpoint would lose its whole attempt)
    preempt_checkpointable: bool = False
    # An experiment, never a default: the policy is told each job's true remaining
    # run time through the same inputs a prediction reaches it by (a pending job's
    # ``planned_s``; a running job's ``planned_s`` up to its true end, without
    # progress), the upper bound of what better predictions could buy.
    oracle_runtime: bool = False


@dataclass
class SimResult:
    jobs: list[SimJob]
    passes: int = 0
    passes_by_trigger: Counter[str] = field(default_factory=Counter)
    periodic_skipped: int = 0
    decide_ms: list[float] = field(default_factory=list)
    preemptions: int = 0
    lost_gpu_s: float = 0.0  # work thrown away by preemptions
    kept_gpu_s: float = 0.0  # work of preempted attempts kept by checkpoints
    resumes: int = 0  # starts from a checkpoint (each paid the restart overhead)
    # restart overheads: paid (GPUs x seconds, at each resumed start), and the part
    # of them inside preempted attempts (already in ``lost_gpu_s``)
    overhead_gpu_s: float = 0.0
    overhead_in_lost_gpu_s: float = 0.0
    busy_gpu_s: float = 0.0  # time GPUs held at least one job
    shared_gpu_s: float = 0.0  # time GPUs held two jobs or more
    # co-location: one entry per (joiner, partner) of each shared start:
    # (time, joiner id, partner id, trial, true combined normalised throughput;
    # 0 for a pair that does not fit)
    admissions: list[tuple[float, int, int, bool, float]] = field(default_factory=list)
    requeues: int = 0  # OOM failures and evictions
    oom_failures: int = 0
    evictions: int = 0
    oom_lost_gpu_s: float = 0.0  # GPU time held by attempts that failed OOM
    evicted_work_s: float = 0.0  # solo-seconds done by evicted attempts
    shared_timeouts: int = 0  # timed out in an attempt that shared a GPU
    # what exploration trials cost: GPU time of trial joiners that failed out of
    # memory plus work of evicted trial attempts; GPU time lost while a trial
    # pair did less than one GPU's worth (length x (1 - combined)); job-seconds
    # truly over a cap in trial episodes
    trial_lost_gpu_s: float = 0.0
    trial_shared_loss_gpu_s: float = 0.0
    trial_over_cap_s: float = 0.0
    observations: int = 0  # sharing episodes that became knowledge
    # a job truly over its cap longer than this was not stopped in time: the
    # detection window plus one pass period (when the pass that sees it runs)
    over_cap_window_s: float = 0.0
    total_gpus: int = 0
    slipped: int = 0
    with_est_start: int = 0
    throughput_fallbacks: int = 0
    samples: list[tuple[float, int, int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    # ``PassStats`` summed over the passes: seconds and passes per stage, passes
    # by stop reason, and the counts (considered, started, ...)
    stage_s: dict[str, float] = field(default_factory=dict)
    stage_passes: Counter[str] = field(default_factory=Counter)
    passes_by_stop: Counter[str] = field(default_factory=Counter)
    pass_counts: Counter[str] = field(default_factory=Counter)

    def record(self, stats: PassStats) -> None:
        """Add one pass's ``PassStats``."""
        for stage, seconds in stats.stage_s.items():
            self.stage_s[stage] = self.stage_s.get(stage, 0.0) + seconds
            self.stage_passes[stage] += 1
        self.passes_by_stop[stats.stop_reason] += 1
        counts = self.pass_counts
        counts["considered"] += stats.considered
        counts["started"] += stats.started
        counts["preempted"] += stats.preempted
        counts["reserved"] += stats.reserved
        counts["backfilled"] += stats.backfilled
