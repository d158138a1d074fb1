"""The policy's inputs and outputs: frozen plain data, no Django, no I/O, no clock.

The Celery pass (``scheduler.services.cluster_state``) and the simulator
(``scheduler.sim``) both build a ``ClusterState`` and call ``decide``; only
``scheduler.services.apply_decisions`` (or the simulator's physics) acts on the
decisions. Everything the policy may know is here: requests, labels, limits,
predictions from history, decayed usage. Never true durations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

from scheduler.policy.interference import Knowledge

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scheduler.policy.colocate import Admission
    from scheduler.policy.remaining import Progress

# ------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class ClassSpec:
    """A priority class (``GPULAB_PRIORITY_CLASSES``)."""

    name: str
    weight: float  # the class factor, 0..1
    preemptible: bool = False
    slowdown_cap: float | None = 1.5  # co-location: the class's slowdown cap
    # Interactive jobs' class (JupyterLab, a terminal): only interactive jobs run
    # in it and none other; the policy places them ahead of batch work.
    interactive: bool = False


# The classes gpulab ships: what the policy knows of each (``portal.settings``
# derives the default ``GPULAB_PRIORITY_CLASSES`` from it, adding time limits and
# idle actions; the simulator replays with it).
DEFAULT_CLASSES: Mapping[str, ClassSpec] = MappingProxyType(
    {
        "high": ClassSpec("high", 1.0, preemptible=False, slowdown_cap=1.5),
        "normal": ClassSpec("normal", 0.5, preemptible=False, slowdown_cap=1.5),
        "best-effort": ClassSpec(
            "best-effort", 0.0, preemptible=True, slowdown_cap=None
        ),
        "interactive": ClassSpec(
            "interactive", 1.0, preemptible=False, slowdown_cap=1.5, interactive=True
        ),
    }
)


# ``gpulab`` and its two co-location baselines: the same multifactor policy with
# the run-time factor, preemption and topology (``policy.decide``).
GPULAB_FAMILY = ("gpulab", "gpulab-exclusive", "pack-by-memory")


@dataclass(frozen=True)
class PolicyConfig:
    """Which policy and its knobs (settings ``GPULAB_POLICY*``)."""

    name: str = "gpulab"  # "fifo" | "slurm" | "gpulab"
    # Multifactor weights (Slurm's PriorityWeight*): each factor is in [0, 1].
    weight_class: float = 1000.0
    weight_age: float = 500.0
    weight_fairshare: float = 1000.0
    # ``gpulab``: the user's part of fair share within its group, 0..1
    # (``fairshare``): 1 moves a job within [F_group / 2, F_group] by its owner's
    # usage; 0: only groups compete by usage (``slurm`` always weighs users)
    fairshare_user: float = 1.0
    weight_size: float = 100.0
    # ``gpulab`` only: shorter planned run times first (``priority.runtime_factor``).
    weight_runtime: float = 500.0
    # the planned run time whose factor is 0: shortest-first among jobs planned
    # under 6 h; longer jobs keep their age / fair-share order (docs/policy.md)
    runtime_ref_s: float = 6 * 3600.0
    # the head start a waiting job earns by waiting, in GPU-seconds: its run-time
    # part is at least ``weight_runtime`` x min(1, GPUs x seconds waited / this),
    # so a wide job is not passed for days by short narrow ones; 0: off
    runtime_age_gpu_s: float = 0.0
    # only jobs of at least this many GPUs earn that head start (1: every job)
    runtime_age_min_gpus: int = 1
    max_age_s: float = 7 * 86400.0  # the age factor saturates here
    backfill: bool = True
    # ``gpulab``: how backfill plans a job's end: "limit" (its time limit, as Slurm
    # does) or "prediction" (min(limit, predicted run time)); ``slurm`` always
    # plans with limits. The run-time factor reads the prediction either way.
    backfill_plan: str = "limit"
    # How a waiting job's run time is predicted from history (``policy.predict``,
    # at submit in production, in the simulator's views): "longest" (the longest
    # of the owner's last runs) or "pools" (the median of the most specific pool
    # of similar jobs, time limit included). The pass itself reads ``planned_s``.
    prediction: str = "longest"
    backfill_max_tested: int = 500
    # Preemption: a job is preempted at most this many times per hour.
    preempt_max_per_hour: int = 2
    # ``gpulab``: the top blocked job may preempt checkpointable jobs by least
    # attained service (``preempt.las_candidates``); none is preempted sooner
    # than this after its own start (``GPULAB_PREEMPT_MIN_RUN``).
    las_preemption: bool = True
    preempt_min_run_s: float = 600.0
    # the two LAS queues' boundary: a job with this much attained service (GPUs x
    # seconds run) is in the lower queue (Tiresias' 16 GPU-h on (b), docs/policy.md)
    las_threshold_gpu_s: float = 16 * 3600.0
    # the LAS wait bound: a job whose time since submission is over this many
    # times its service time (attained / GPUs) is neither preempted by attained
    # service nor held back by ``las_order``
    las_max_slowdown: float = 2.0
    # ``gpulab``: the wait bound (``wait_bound``): a batch job that has waited
    # (time in the system not running) longer than this goes ahead of every job
    # of its class and below and is not preempted by attained service; 0: none.
    # 4 days: a queue of overdue wide jobs then starts two days sooner than at 6
    # (docs/policy.md, "The (b) tail with predictions by pools, job by job")
    max_wait_s: float = 96 * 3600.0
    # ``gpulab``: the bound after a preemption (``wait_bound``): a waiting job
    # that was preempted and has waited longer than this since is overdue as
    # above, and a job that restarted that long after its last preemption is not
    # preempted by attained service again; 0: none (only ``max_wait_s``).
    preempted_max_wait_s: float = 0.0
    # waiting jobs after the top blocked job that may each get a preemption plan
    # by attained service in one pass (``stages.las_extra``; 0: the top one only)
    las_extra_plans: int = 0
    # the order LAS victims are tried in: "attained" (the most attained service
    # first), "checkpoint" (the least work lost since the last checkpoint first)
    # or "remaining" (the most time left first, ``preempt.remaining_s``)
    las_victims: str = "attained"
    # LAS victims only among the jobs with more time left than the waiting job
    # is planned to run (``preempt.las_candidates``)
    las_shorter: bool = False
    # Guests (``stages.backfill_one``): a checkpointable job that fits now only
    # on GPUs the top blocked job's reservation holds, and would run past its
    # shadow time, starts there anyway as a guest, and is preempted for the top
    # blocked job when that job could start but for guests (``preempt.guests``).
    # "off" (the default); "on": any such job; "predicted": only one whose
    # prediction ends by the shadow time (the limit alone would keep it out):
    # docs/policy.md, "Guests on reserved GPUs".
    guest_backfill: str = "off"
    # Placement: "pack" (best fit) or "spread".
    placement: str = "pack"
    # Co-location (``colocate``): shareable single-GPU jobs may join a busy GPU.
    colocation: bool = True
    colo_headroom_mib: int = 512  # added to each job's memory need
    colo_gain_margin: float = 0.05  # 1/r_AB + 1/r_BA must reach 1 + this
    # an exploration trial's predicted gain must reach 1 + this (when above
    # ``colo_gain_margin``): the prediction of an untried pair is less sure than
    # an observation, so pairs predicted to gain barely are not tried. 0: trials
    # need what known pairs need. At 0.10, over ten seeds: half the bad trials on
    # (b) and a fifth less spent on trials, the same average JCT; on K80 trial
    # costs cut by a third, the average within its standard error of margin 0
    # (docs/policy.md, "A higher bar for trials by default")
    colo_trial_gain_margin: float = 0.10
    colo_min_confidence: float = 0.5  # below: the pair is unknown (a trial)
    colo_trials_per_pair_hour: int = 1
    colo_trials_per_hour: int = 10
    # a trial needs at least these odds of the pair being admissible once seen,
    # from the pairs tried so far (``interference.Outcomes``); 0: no such check.
    # Off by default: at 0.04 and 0.1 it stopped exploration on (b) before any
    # pair was found admissible (docs/policy.md, "Cheaper exploration")
    colo_trial_min_odds: float = 0.0
    # k > 0: trials are ranked by their odds (among the GPUs a job may join, the
    # partner whose family pair has the best record first), and a trial of a
    # family pair that failed k times with no win is refused; the relation (one
    # family, or two) only orders, it never refuses (``interference.Outcomes``).
    # 0: off. Off by default: at k = 2-5 it cut trial costs 2-4 times on (b) and
    # K80 but lost the whole co-location gain on (b) (docs/policy.md, "No job left
    # a hair over its cap; ranked trials with a per-family stop")
    colo_trial_max_failures: int = 0
    # "exclusive-first": share only when no free GPU fits; "pack": share first,
    # leaving whole GPUs free for large jobs
    colo_packing: str = "exclusive-first"
    # "full": rules 1-4 (gpulab); "memory": memory and count only (pack-by-memory)
    colo_rule: str = "full"
    # a job slowed over its cap is stopped within this window: its partner (the
    # later job, if its owner allows it) is evicted once the slowdown has been
    # measured over the cap for half of it (reports lag the episode's start)
    colo_detect_window_s: float = 600.0
    # an exploration trial is ended at its first measurement (two reports) that
    # shows a job over its cap by more than this fraction, not after half the
    # window; None: off (docs/policy.md, "Cheaper exploration": on (b) it kept
    # 12 % of the oracle's gain against 89 % without)
    colo_trial_evict_margin: float | None = None
    # admission keeps a job's predicted slowdown this fraction under its cap, so
    # a pair measured just under the cap (within the noise) is not admitted
    colo_cap_margin: float = 0.02
    # a job on a GPU beside one partner whose pair was observed before is judged
    # by the pair's earlier episodes and the current one together, and evicted
    # when that figure plus this many standard errors is over its cap (instead
    # of the current measurement within ``colo_cap_margin`` of it); None: off.
    # 2: kept only while the pair is about 97.7 % sure to be within the cap
    colo_evict_z: float | None = 2.0
    # a pair seen before and refused for protection is tried again (a watched
    # trial, on the trial budget) while seen in fewer than ``colo_retrial_episodes``
    # episodes and over a cap by less than this many standard errors of its
    # record (``colocate._retrial``); None: off. At 2, colo-b's ten seeds gain
    # 92 % of the oracle's gain against 72 % without (docs/policy.md, "Re-trials
    # within the noise of a cap")
    colo_retrial_z: float | None = 2.0
    colo_retrial_episodes: int = 3
    # Quotas (``policy.quota``): a job over a soft quota has its fair-share factor
    # multiplied by this; a running job over a hard quota is stopped ("stop") or
    # runs to its end ("finish").
    quota_soft_factor: float = 0.5
    quota_overrun: str = "finish"
    # A running job that reports progress is planned to end when its progress
    # says (``remaining.expected_end``), capped by its limit; ``slurm`` and
    # ``fifo`` never read progress (Slurm plans with limits).
    progress_ends: bool = True

    @property
    def shares(self) -> bool:
        """This policy may put two jobs on one GPU."""
        return self.colocation and self.name in ("gpulab", "pack-by-memory")

    @property
    def ranks_by_runtime(self) -> bool:
        """The run-time factor orders this policy's queue (``gpulab``'s policies;
        ``slurm`` and ``fifo`` have none)."""
        return self.name in GPULAB_FAMILY and self.weight_runtime > 0

    @property
    def plans_with_progress(self) -> bool:
        """A running job's reported progress sets its planned end."""
        return self.progress_ends and self.name not in ("slurm", "fifo")

    @property
    def plans_with_prediction(self) -> bool:
        """Backfill plans jobs with min(limit, prediction), not their limits."""
        return (
            self.name != "slurm"
            and self.name != "fifo"
            and (self.backfill_plan == "prediction")
        )


# ------------------------------------------------------------------ cluster


@dataclass(frozen=True)
class NodeView:
    id: int
    name: str
    schedulable: bool = True  # up, not draining, not in maintenance


@dataclass(frozen=True)
class GpuView:
    id: int
    node_id: int
    index: int
    memory_total_mib: int
    slots: int
    free_slots: int
    schedulable: bool = True
    model: str = ""  # e.g. "NVIDIA A100-80GB"
    nvlink_peers: tuple[int, ...] = ()  # indexes on the same node
    # (peer index, NVML common-ancestor level): lower is closer.
    topology: tuple[tuple[int, int], ...] = ()


# ------------------------------------------------------------------ jobs


@dataclass(frozen=True)
class Dependency:
    """One dependency of a pending job (``policy.dependency``): it may
    start once job ``job_id`` has ended as ``kind`` asks ("afterok", "afterany",
    "afternotok"). ``status`` is that job's state now (a ``Job.Status`` value,
    e.g. "running", "completed", "failed"); ``exit_code`` its exit, if any."""

    kind: str
    job_id: int
    status: str
    exit_code: int | None = None


@dataclass(frozen=True)
class PendingJob:
    id: int
    gpus: int
    gpu_memory_mib: int | None
    priority_weight: float  # the class factor, 0..1 (kept for the fifo policy)
    submitted_at: float  # seconds since the epoch (age is kept across requeues)
    user: str = ""
    group: str = ""
    priority_class: str = "normal"
    gpu_model: str = ""  # a required GPU model (substring, case-insensitive)
    time_limit_s: float = 86400.0
    # Planned run time: min(limit, prediction from similar past jobs).
    planned_s: float = 86400.0
    shareable: bool = False
    # Co-location (``colocate``): the workload label ("ResNet-50 (batch size 64)")
    # and the slowdown cap (class cap, or the tighter one the owner asked for;
    # None: unbounded).
    workload: str = ""
    slowdown_cap: float | None = 1.5
    # A task of job array ``array_id``, of which at most ``array_limit``
    # run at once (None: no limit; ``policy.arrays``), and the jobs it waits for.
    array_id: int | None = None
    array_limit: int | None = None
    dependencies: tuple[Dependency, ...] = ()
    # GPU-seconds its earlier attempts ran (its attained service, for LAS), and
    # whether it saves its work when stopped (``Job.checkpointable``)
    attained_gpu_s: float = 0.0
    checkpointable: bool = False
    # when it was last preempted (None: never); ``preempt.las_order`` reads it;
    # and how many times in the hour before the pass (``stages._guest``)
    preempted_at: float | None = None
    preemptions_last_hour: int = 0


@dataclass(frozen=True)
class RunningJob:
    id: int
    gpu_ids: tuple[int, ...]
    started_at: float
    planned_s: float  # min(limit, predicted); backfill plans with it
    time_limit_s: float
    user: str = ""
    group: str = ""
    priority_class: str = "normal"
    preemptible: bool = False
    preemptions_last_hour: int = 0
    # A stop was requested (preempted, over its limit, cancelled): its GPUs free
    # within its grace period. The policy counts them as freeing now, so a job
    # waiting for a preemption is not given a second, extra set of victims while
    # the first set is still in its grace period.
    stopping: bool = False
    # Co-location. A shareable single-GPU job may have partners on its GPU;
    # ``joined_at`` is set on the job that joined a busy GPU (the later job).
    shareable: bool = False
    workload: str = ""
    gpu_memory_mib: int | None = None  # declared
    peak_memory_mib: int | None = None  # measured by the agents
    slowdown_cap: float | None = 1.5
    joined_at: float | None = None
    trial: bool = False  # admitted as an exploration trial
    # Its slowdown measured over the current sharing episode (progress rate shared
    # over its workload's solo rate) and for how long it has been measured.
    measured_slowdown: float | None = None
    measured_for_s: float = 0.0
    # The owner allows a harmful pair's later job to be sent back to the queue.
    evictable: bool = True
    # A task of this job array (its run-at-once limit counts it).
    array_id: int | None = None
    # What it reported of its progress over this attempt (None: nothing usable
    # yet); ``remaining.expected_end`` reads it.
    progress: Progress | None = None
    # It saves its work when stopped (``Job.checkpointable``): the LAS stage may
    # preempt it. ``prior_gpu_s``: GPU-seconds its earlier attempts ran.
    checkpointable: bool = False
    prior_gpu_s: float = 0.0
    submitted_at: float | None = None  # (None: unknown; the LAS wait bound skips it)
    # When its current attempt last reported a checkpoint (``Attempt.checkpoint_at``,
    # epoch seconds; None: none yet): stopped now it loses the work since then.
    checkpoint_at: float | None = None
    # Started as a guest on GPUs a reservation held (``Start.guest``): it yields
    # them to the top blocked job (``preempt.guests``).
    guest: bool = False
    # When it was last preempted, before this attempt (None: never); the wait
    # bound after a preemption reads it (``wait_bound.overdue_running``).
    preempted_at: float | None = None

    def las_slowdown(self, now: float) -> float:
        """Time since its submission over its service time (attained / GPUs);
        0 when its submission is unknown."""
        if self.submitted_at is None:
            return 0.0
        served = self.attained_gpu_s(now) / max(len(self.gpu_ids), 1)
        return (now - self.submitted_at) / served if served > 0 else float("inf")

    def attained_gpu_s(self, now: float) -> float:
        """Its attained service at ``now``: GPUs x seconds run, every attempt."""
        return self.prior_gpu_s + len(self.gpu_ids) * max(now - self.started_at, 0.0)

    @property
    def planned_end(self) -> float:
        return self.started_at + self.planned_s


@dataclass(frozen=True)
class Usage:
    """Decayed GPU-seconds (half-life decay done by the loader) and shares."""

    group_usage: Mapping[str, float] = field(default_factory=dict)
    user_usage: Mapping[tuple[str, str], float] = field(default_factory=dict)
    group_shares: Mapping[str, float] = field(default_factory=dict)
    user_shares: Mapping[tuple[str, str], float] = field(default_factory=dict)


@dataclass(frozen=True)
class QuotaView:
    """One quota and its state now (``portal.quotas.usage`` computes it;
    ``policy.quota`` enforces it).

    Exactly one of ``group`` / ``user`` is set: the group's name (jobs charged to
    it) or the user's name (their jobs in any group)."""

    id: int
    group: str = ""
    user: str = ""
    hard: bool = True
    gpu_hours: float | None = None  # limit per period; None: no GPU-hour limit
    used_gpu_hours: float = 0.0  # in the current period, running jobs included
    max_gpus: int | None = None  # concurrent cap; None: no cap
    running_gpus: int = 0  # GPUs held now by live attempts subject to it
    period: str = "month"  # "month", "week" or e.g. "30 days": for messages
    resets_at: float = 0.0  # the next period start, epoch seconds

    @property
    def label(self) -> str:
        return f"group {self.group}" if self.group else f"user {self.user}"

    @property
    def exhausted(self) -> bool:
        """Its GPU-hours for the period are used up."""
        return self.gpu_hours is not None and self.used_gpu_hours >= self.gpu_hours

    def applies_to(self, group: str, user: str) -> bool:
        return self.user == user if self.user else self.group == group


@dataclass(frozen=True)
class ClusterState:
    now: float
    nodes: tuple[NodeView, ...]
    gpus: tuple[GpuView, ...]
    pending: tuple[PendingJob, ...]
    running: tuple[RunningJob, ...] = ()
    usage: Usage = field(default_factory=Usage)
    classes: Mapping[str, ClassSpec] = field(
        default_factory=lambda: MappingProxyType({})
    )
    config: PolicyConfig = field(default_factory=PolicyConfig)
    # Co-location: what was learned about pairs, and the exploration trials
    # started in the last hour per unordered workload pair.
    knowledge: Knowledge = field(default_factory=Knowledge)
    trials_last_hour: Mapping[frozenset[str], int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # Quotas (``policy.quota``) and their state now; the simulator passes none.
    quotas: tuple[QuotaView, ...] = ()


def is_interactive(state: ClusterState, job: RunningJob | PendingJob) -> bool:
    """``job`` runs in an interactive class (``ClassSpec.interactive``): it is
    ordered ahead of batch work and never preempted nor evicted."""
    spec = state.classes.get(job.priority_class)
    return spec is not None and spec.interactive


# ------------------------------------------------------------------ decisions


class Reason(StrEnum):
    """Why a job is still pending: exactly one code per job per pass (Slurm's
    ``job_state_reason``)."""

    PRIORITY = "priority"  # higher-priority jobs come first
    RESOURCES = "resources"  # it fits the cluster, not the free GPUs now
    RESERVED_FOR_HIGHER = "reserved"  # free GPUs are held for a higher job
    NO_SUCH_SHAPE = "no_such_shape"  # no set of nodes could ever hold it
    QUOTA = "quota"  # quota exhausted (``policy.quota``)
    HELD = "held"
    DEPENDENCY = "dependency"  # waits for other jobs to end (``policy.dependency``)
    DEPENDENCY_NEVER = "dependency_never"  # a dependency can never be met
    ARRAY_LIMIT = "array_limit"  # its array runs its %N tasks at once
    WAITING_FOR_PREEMPTION = "preempting"  # victims are being stopped for it
    NOT_TESTED = "not_tested"  # a pass cap stopped before this job


@dataclass(frozen=True)
class Placement:
    """The GPUs a job takes on one node (a multi-node job has several)."""

    node_id: int
    gpu_ids: tuple[int, ...]


@dataclass(frozen=True)
class Start:
    """Start ``job_id`` on ``placements`` (rank order), taking every slot of each GPU."""

    job_id: int
    placements: tuple[Placement, ...]
    backfilled: bool = False
    # Set when the job joins a GPU that already runs jobs (one slot of it): the
    # admission record (rule, predicted slowdowns, partners), shown on its page.
    admission: Admission | None = None
    # A guest: it took GPUs the top blocked job's reservation holds and yields
    # them when that job can start (``PolicyConfig.guest_backfill``).
    guest: bool = False

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return tuple(g for p in self.placements for g in p.gpu_ids)

    @classmethod
    def on(cls, job_id: int, node_id: int, gpu_ids: tuple[int, ...]) -> Start:
        """A single-node start."""
        return cls(job_id, (Placement(node_id, tuple(gpu_ids)),))


@dataclass(frozen=True)
class Preempt:
    """Stop ``victim_id`` (preemptible) so that ``for_job_id`` can start; the victim
    goes back to the queue with its age kept."""

    victim_id: int
    for_job_id: int
    reason: str


@dataclass(frozen=True)
class Evict:
    """Stop ``job_id``, the later job of a shared GPU whose measured slowdown is
    over a cap for the detection window, and return it to the queue (age kept);
    ``pair`` (its workload, its partner's) is refused from then on when
    ``harmful`` (a trial ended for running too close to a cap, not over it, is
    not: its measured episode says whether the pair is admitted later)."""

    job_id: int
    partner_id: int
    reason: str
    pair: tuple[str, str] = ("", "")
    harmful: bool = True


@dataclass(frozen=True)
class QuotaStop:
    """Stop running ``job_id``: a hard quota it is subject to is used up and
    ``GPULAB_QUOTA_OVERRUN`` is ``stop``. The job ends CANCELLED, not requeued."""

    job_id: int
    quota_id: int
    reason: str


@dataclass(frozen=True)
class Wait:
    """``job_id`` stays pending for ``reason``; ``message`` explains it to a person."""

    job_id: int
    reason: Reason
    message: str
    position: int = 0  # 1-based place in the scheduling order
    # Weighted priority factors (what `sprio` shows), their sum is the priority.
    breakdown: Mapping[str, float] = field(default_factory=dict)
    est_start: float | None = None  # the reservation's planned start, if any


# Why a pass stopped looking at waiting jobs (``PassStats.stop_reason``).
STOP_QUEUE_EXHAUSTED = "queue exhausted"  # it reached the end of the queue
# the backfill test budget (``PolicyConfig.backfill_max_tested``) ran out: later
# jobs wait ``NOT_TESTED``
STOP_BACKFILL_MAX_TESTED = "backfill_max_tested"
# backfill is off (``PolicyConfig.backfill``): jobs after the top blocked job wait
# ``PRIORITY`` untried
STOP_BACKFILL_OFF = "backfill off"
STOP_REASONS = (STOP_QUEUE_EXHAUSTED, STOP_BACKFILL_MAX_TESTED, STOP_BACKFILL_OFF)

# The stages of a pass, in the order they run (``PassStats.stage_s`` keys;
# ``multifactor`` runs them all, ``fifo`` only ordering and placement).
STAGE_SETUP = "setup"  # index, ledger, quotas, fair share; quota stops
STAGE_ORDERING = "ordering"  # priority factors and the scheduling order
STAGE_PLACEMENT = "placement"  # gate and place in order up to the top blocked job
STAGE_COLOCATION = "colocation"  # evictions, then every try to share a GPU
STAGE_RESERVATION = "reservation"  # preemption plan or EASY reservation
STAGE_BACKFILL = "backfill"  # the jobs after the top blocked job
STAGE_REASONS = "reasons"  # one Wait per job not started
STAGES = (
    STAGE_SETUP,
    STAGE_COLOCATION,
    STAGE_ORDERING,
    STAGE_PLACEMENT,
    STAGE_RESERVATION,
    STAGE_BACKFILL,
    STAGE_REASONS,
)


@dataclass(frozen=True)
class PassStats:
    """What one pass did and what each of its stages cost (Slurm's ``sdiag``, per
    pass). ``stop_reason`` (one of ``STOP_REASONS``) says why the pass stopped
    looking at waiting jobs: ``STOP_QUEUE_EXHAUSTED`` when it reached the end of
    the queue, otherwise the limit that ended it.

    ``stage_s`` maps each stage that ran (``STAGES``) to its seconds of
    ``time.perf_counter``. It is a measurement only: no decision reads a clock, so
    the same state always gives the same decisions; time spent sharing GPUs is
    counted under ``colocation``, not under the placement or backfill around it."""

    considered: int = 0  # waiting jobs the ordering stage ranked
    started: int = 0  # ``Start`` decisions, backfilled ones included
    preempted: int = 0  # ``Preempt`` decisions
    reserved: int = 0  # jobs given a reservation (a planned start)
    backfilled: int = 0  # starts that went ahead of a reservation
    stop_reason: str = STOP_QUEUE_EXHAUSTED
    stage_s: Mapping[str, float] = field(default_factory=dict)  # stage -> seconds


@dataclass(frozen=True)
class PassResult:
    """``run_pass``'s answer: the decisions and what the pass did to reach them."""

    decisions: list[Decision]
    stats: PassStats


Decision = Start | Preempt | Evict | QuotaStop | Wait
