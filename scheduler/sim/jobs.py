"""The jobs a replay moves: ``RawJob`` (a trace row as read), ``SimJob`` (a job
as the engine replays it: its request, its ground truth and its physics) and
``PreparedTrace`` (the jobs ``prepare.prepare`` made, with what it skipped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.sim.colocation import Segment


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
    checkpointable: bool | None = None  # None: no ``checkpointable`` value
    checkpoint_interval_s: float | None = None  # None: ``--checkpoint-interval``


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
    # a preempted checkpointable job keeps its work up to its last checkpoint and
    # pays a restart overhead when it resumes; any other loses its attempt
    checkpointable: bool = False
    checkpoint_interval_s: float | None = None  # None: ``SimOptions``'
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
    queued_at: float = 0.0  # when it last became pending (arrival or requeue)
    last_run_s: float = 0.0  # the length of its last stopped attempt
    done_fraction: float = 0.0  # of its work, kept by checkpoints of stopped attempts
    overhead_s: float = 0.0  # restart overhead paid in the current attempt
    # the limit counts the progress a job keeps: a resumed attempt may run what
    # its kept progress left of the limit (plus its restart overhead), so a job
    # longer than its limit times out under every policy
    limit_used_s: float = 0.0
    attempt_limit: float = 0.0  # this attempt's limit, from its start
    resumes: int = 0  # attempts started from a checkpoint
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
    guest: bool = False  # started as a guest on reserved GPUs (``Start.guest``)
    doomed: bool = False  # joined a partner it cannot fit beside: fails at start
    progress_from: float = 0.0  # its start, or when the partner it could not fit
    # beside left before it failed
    shared_attempt: bool = False  # shared a GPU during this attempt
    shared_s: float = 0.0  # seconds spent sharing, all attempts
    max_true_slowdown: float = 1.0  # worst 1/rate of its sharing episodes
    over_cap_s: float = 0.0  # longest sharing episode truly over its cap

    @property
    def last_preempted_at(self) -> float | None:
        """When it was last preempted (None: never): the policy views'
        ``preempted_at``."""
        return self.preempt_times[-1] if self.preempt_times else None


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
    # rows of the trace left out of the case before any was looked at:
    # ``other_vc`` (``--vc``) and ``beyond_max_jobs`` (``--max-jobs``)
    outside_case: dict[str, int] = field(default_factory=dict)
