"""The simulated cluster's state: its GPUs and their occupants, the queues and
the policy's cached views of them, run-time history, decayed usage, the event
heap. ``SimCluster`` builds it; ``gpus.GpuPhysics``, ``views.PolicyViews`` and
``engine.Simulator`` add the physics, the policy's view and the replay."""

from __future__ import annotations

import heapq
from collections import deque
from types import MappingProxyType
from typing import TYPE_CHECKING

from scheduler.policy import (
    ClusterState,
    GpuView,
    NodeView,
    PassResult,
    PendingJob,
    PolicyConfig,
    RunningJob,
    run_pass,
)
from scheduler.policy.predict import History, PoolKey, Request
from scheduler.sim.colocation import Meter
from scheduler.sim.progress import ProgressModel, ProgressTracker
from scheduler.sim.results import SimOptions, SimResult
from scheduler.sim.usage import DecayedUsage

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from agents.spec import NodeSpec
    from scheduler.policy import Decision
    from scheduler.sim.colocation import ColocationTable
    from scheduler.sim.jobs import SimJob
    from scheduler.sim.trace import Throughputs

# Event kinds, in the order events at one timestamp are applied.
END = 0
PREEMPT_DONE = 1
OOM_FAIL = 2
ARRIVAL = 3
PERIODIC = 4


class SimCluster:
    """The state of one replay (node ids 1.., GPU ids 1.. in index order) and its
    event heap."""

    def __init__(
        self,
        jobs: Sequence[SimJob],
        nodes: Sequence[NodeSpec],
        config: PolicyConfig,
        options: SimOptions | None = None,
        *,
        throughputs: Throughputs | None = None,
        colocation: ColocationTable | None = None,
        decide_fn: Callable[[ClusterState], list[Decision]] | None = None,
        pass_fn: Callable[[ClusterState], PassResult] = run_pass,
    ) -> None:
        """``pass_fn``: the pass (``policy.run_pass``: its decisions and
        ``PassStats``); ``decide_fn``, when given, replaces it with a bare decision
        function (a test's policy) whose passes record no ``PassStats``."""
        self.opts = options or SimOptions()
        if self.opts.gpu_job_limit < 1:
            raise ValueError("gpu_job_limit must be >= 1")
        self.config = config
        self.decide = decide_fn
        self.run_pass = pass_fn
        self.table = throughputs
        self.colocation = colocation
        # progress reports are measured only when there is something to share
        self.meter = Meter(seed=self.opts.seed) if colocation is not None else None
        self.jobs = list(jobs)
        self.by_id = {j.id: j for j in self.jobs}
        if len(self.by_id) != len(self.jobs):
            raise ValueError("job ids must be unique")
        # Cluster: node ids 1.., GPU ids 1.. (index order within a node).
        self.nodes = tuple(
            NodeView(i + 1, f"node{i + 1:04d}") for i in range(len(nodes))
        )
        self.slots = self.opts.gpu_job_limit
        self.gpu_node: dict[int, int] = {}
        self.gpu_model: dict[int, str] = {}
        self.gpu_mem: dict[int, int] = {}
        self.free_view: dict[int, GpuView] = {}
        self.views: dict[tuple[int, int], GpuView] = {}  # (gpu, free slots)
        gid = 0
        for node_id, spec in enumerate(nodes, start=1):
            for index in range(spec.gpus):
                gid += 1
                peers = (
                    tuple(i for i in range(spec.gpus) if i != index)
                    if spec.nvlink
                    else ()
                )
                view = GpuView(
                    id=gid,
                    node_id=node_id,
                    index=index,
                    memory_total_mib=spec.memory_mib,
                    slots=self.slots,
                    free_slots=self.slots,
                    model=spec.model,
                    nvlink_peers=peers,
                )
                self.free_view[gid] = view
                self.gpu_node[gid] = node_id
                self.gpu_model[gid] = spec.model
                self.gpu_mem[gid] = spec.memory_mib
        self.total_gpus = gid
        # GPU id -> its jobs in arrival order, and the slots they take
        self.occupants: dict[int, list[int]] = {}
        self.used: dict[int, int] = {}
        self.gpu_since: dict[int, float] = {}  # last change of its occupants
        self.shared_gpus: set[int] = set()  # GPUs where 2+ jobs progress together
        self.gpu_list: list[GpuView] = [self.free_view[g] for g in range(1, gid + 1)]
        self.gpu_tuple: tuple[GpuView, ...] | None = None
        # Queues and views.
        self.pending: dict[int, SimJob] = {}
        self.pending_views: dict[int, PendingJob] = {}
        self.pending_by_user: dict[str, set[int]] = {}
        self.running: dict[int, SimJob] = {}
        self.running_views: dict[int, RunningJob] = {}
        self.recently_preempted: set[int] = set()
        # waiting jobs whose view may count a preemption within the hour
        self.preempted_pending: set[int] = set()
        self.stale_views: set[int] = set()  # running jobs whose view changed
        # ``las_victims`` "checkpoint": when each running checkpointable job's
        # next checkpoint falls (its view's ``checkpoint_at`` moves then)
        self.checkpoint_due: dict[int, float] = {}
        # exploration trials started: (time, unordered workload pair)
        self.trials: deque[tuple[float, frozenset[str]]] = deque()
        # History for run-time prediction (completed jobs only).
        self.hist_label: dict[tuple[str, str], deque[float]] = {}
        self.hist_user: dict[str, deque[float]] = {}
        self.user_version: dict[str, int] = {}
        self.stale_users: set[str] = set()
        # ``--prediction pools``: every pool's last runs, the pending jobs by what
        # keys their pools, each such request's last prediction, the requests
        # whose prediction each pool decides (``predict.deciding_keys``) and
        # the keys each request is watching, and the pools that gained a run
        # since the last pass: a completion re-predicts only the requests
        # watching one of its pools, not every waiting one
        self.pools = History(self.opts.history_n)
        self.pending_by_request: dict[Request, set[int]] = {}
        self.request_prediction: dict[Request, tuple[float | None, str]] = {}
        self.pool_watchers: dict[PoolKey, set[Request]] = {}
        self.request_watching: dict[Request, tuple[PoolKey, ...]] = {}
        self.pools_changed: set[PoolKey] = set()
        self.usage = DecayedUsage(self.opts.half_life_s)
        self.groups = sorted({j.group for j in self.jobs})
        self.users = sorted({(j.group, j.user) for j in self.jobs})
        self.group_shares = MappingProxyType(dict.fromkeys(self.groups, 1.0))
        self.user_shares = MappingProxyType(dict.fromkeys(self.users, 1.0))
        # Events.
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.real_events = 0  # non-periodic events in the heap
        self.periodic_at: float | None = None
        self.dirty = False
        self.result = SimResult(
            jobs=self.jobs,
            total_gpus=self.total_gpus,
            over_cap_window_s=config.colo_detect_window_s + self.opts.period_s,
        )
        self.finished = 0
        # what jobs report of their progress (``sim.progress``)
        opts = self.opts
        self.tracker = ProgressTracker(
            self.jobs,
            ProgressModel(
                opts.progress_fraction,
                opts.early_stop_fraction,
                opts.progress_noise,
                opts.seed,
            ),
            config,
        )

    def _push(self, t: float, kind: int, job_id: int = 0, stamp: int = 0) -> None:
        """``stamp``: the job's ``epoch`` for END, its ``attempt`` otherwise."""
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, job_id, stamp))
        if kind != PERIODIC:
            self.real_events += 1
