"""The setup stage: the pass index, every static lookup of one pass built once (Kubernetes'
CycleState, Kueue's snapshot) and read-only afterwards.

What changes during the pass (free GPUs) lives in ``ledger.Ledger``; this module holds
what does not: nodes, their names and sort keys, every GPU by node, which GPUs match a
job's constraints (cached per constraint, since a pass sees few distinct ones), the
capacity each constraint can ever get, and the running jobs by planned end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

from scheduler.policy.remaining import expected_end, shown_end

if TYPE_CHECKING:
    from scheduler.policy.state import ClusterState, GpuView, PendingJob, RunningJob

UNKNOWN_LEVEL = 99  # a pair of GPUs with no topology entry: farthest apart


class Constraint(NamedTuple):
    """What a job asks of each GPU: a minimum memory and a model substring. A
    NamedTuple: it keys several per-pass dicts, and tuples hash in C."""

    mem: int | None
    model: str  # lower case; "" = any

    @classmethod
    def of(cls, job: PendingJob) -> Constraint:
        return cls(job.gpu_memory_mib, job.gpu_model.strip().lower())

    def matches(self, gpu: GpuView) -> bool:
        if self.mem is not None and gpu.memory_total_mib < self.mem:
            return False
        return not self.model or self.model in gpu.model.lower()


@dataclass
class ConstraintView:
    """One constraint against the cluster, computed once per pass."""

    matching: frozenset[int]  # GPU ids (schedulable or not) that match
    uniform: frozenset[int]  # nodes whose every GPU matches
    mixed: frozenset[int]  # nodes where some GPUs match and some do not
    node_capacity: dict[int, int]  # node -> matching GPUs (all nodes, up or not)
    max_node_capacity: int
    total_capacity: int


@dataclass
class PassIndex:
    state: ClusterState
    schedulable_nodes: frozenset[int]
    node_key: dict[int, tuple[str, int]]  # deterministic tie break: (name, id)
    node_rank: dict[int, int]  # position in node_key order (cheaper to compare)
    gpus_by_node: dict[int, tuple[GpuView, ...]]  # every GPU, by index
    gpu_by_id: dict[int, GpuView]
    free_now: dict[int, list[GpuView]]  # schedulable node -> free schedulable GPUs
    total_gpus: int
    running_by_end: tuple[RunningJob, ...]
    # Plan with min(limit, prediction) (``gpulab``) or with the limit only, as
    # Slurm's backfill does (``slurm``).
    predictions: bool
    # GPU kinds (memory, model): one example each, and per node the ids of each kind
    kind_example: dict[tuple[int, str], GpuView]
    kinds_by_node: dict[int, dict[tuple[int, str], list[int]]]
    # A running job's reported progress sets its planned end
    # (``PolicyConfig.plans_with_progress``).
    progress: bool = False
    _constraints: dict[Constraint, ConstraintView] = field(default_factory=dict)
    _of_job: dict[tuple[int | None, str], Constraint] = field(default_factory=dict)
    _signature: dict[int, int] = field(default_factory=dict)
    _signatures: dict[tuple[object, ...], int] = field(default_factory=dict)
    # per-pass memo of topology choices: (signature, free indexes, k) -> indexes
    choices: dict[tuple[int, tuple[int, ...], int], tuple[int, ...]] = field(
        default_factory=dict
    )

    def planned_s(self, job: PendingJob | RunningJob) -> float:
        """How long backfill plans ``job`` to run."""
        return job.planned_s if self.predictions else job.time_limit_s

    def planned_end(self, r: RunningJob) -> float:
        """A running job's planned end (``remaining.expected_end``): from its
        reported progress where this policy reads progress, capped by its limit;
        else from its plan, and one that outlived its prediction is planned to its
        limit (Tsafrir et al. 2007: a violated prediction is raised to the user's
        estimate)."""
        return _planned_end(r, self.state.now, self.predictions, self.progress)

    def shown_end(self, r: RunningJob) -> float:
        """The end the start times shown to waiting jobs are planned with
        (``remaining.shown_end``): ``planned_end`` with a margin on an end from
        progress."""
        return shown_end(
            r.started_at,
            r.planned_s,
            r.time_limit_s,
            self.state.now,
            r.progress if self.progress else None,
            predictions=self.predictions,
        )

    def constraint(self, job: PendingJob) -> Constraint:
        key = (job.gpu_memory_mib, job.gpu_model)
        got = self._of_job.get(key)
        if got is None:
            got = self._of_job[key] = Constraint.of(job)
        return got

    def signature(self, node_id: int) -> int:
        """Nodes wired alike (same indexes, NVLink peers, topology levels) share a
        number, so a topology choice made on one is reused on the others."""
        got = self._signature.get(node_id)
        if got is None:
            sig = tuple(
                (g.index, g.nvlink_peers, g.topology)
                for g in self.gpus_by_node.get(node_id, ())
            )
            got = self._signatures.setdefault(sig, len(self._signatures))
            self._signature[node_id] = got
        return got

    def view(self, c: Constraint) -> ConstraintView:
        """The constraint's view, computed on first use (a handful per pass)."""
        got = self._constraints.get(c)
        if got is not None:
            return got
        # match GPU kinds (memory, model), not GPUs: a cluster has a handful
        kinds = self.kinds_by_node
        ok = {kind: c.matches(gpu) for kind, gpu in self.kind_example.items()}
        matching: set[int] = set()
        uniform: set[int] = set()
        mixed: set[int] = set()
        capacity: dict[int, int] = {}
        for node_id, by_kind in kinds.items():
            n = 0
            for kind, ids in by_kind.items():
                if ok[kind]:
                    matching.update(ids)
                    n += len(ids)
            capacity[node_id] = n
            if n == len(self.gpus_by_node[node_id]):
                uniform.add(node_id)
            elif n:
                mixed.add(node_id)
        got = ConstraintView(
            frozenset(matching),
            frozenset(uniform),
            frozenset(mixed),
            capacity,
            max(capacity.values(), default=0),
            sum(capacity.values()),
        )
        self._constraints[c] = got
        return got


def is_free(gpu: GpuView) -> bool:
    """Free for an exclusive start: every slot is free (a GPU with some slots taken
    is only for sharing, ``policy.colocate``)."""
    return gpu.schedulable and gpu.slots > 0 and gpu.free_slots == gpu.slots


def _planned_end(
    r: RunningJob,
    now: float,
    predictions: bool,  # noqa: FBT001
    progress: bool,  # noqa: FBT001
) -> float:
    return expected_end(
        r.started_at,
        r.planned_s,
        r.time_limit_s,
        now,
        r.progress if progress else None,
        predictions=predictions,
    )


def build(state: ClusterState, *, predictions: bool = True) -> PassIndex:
    now = state.now
    progress = state.config.plans_with_progress
    schedulable = frozenset(n.id for n in state.nodes if n.schedulable)
    node_key = {n.id: (n.name, n.id) for n in state.nodes}
    by_node: dict[int, list[GpuView]] = {}
    for g in sorted(state.gpus, key=attrgetter("node_id", "index", "id")):
        by_node.setdefault(g.node_id, []).append(g)
        node_key.setdefault(g.node_id, ("", g.node_id))
    kind_example: dict[tuple[int, str], GpuView] = {}
    kinds_by_node: dict[int, dict[tuple[int, str], list[int]]] = {}
    for node_id, gpus in by_node.items():
        by_kind: dict[tuple[int, str], list[int]] = {}
        for g in gpus:
            kind = (g.memory_total_mib, g.model)
            if kind not in kind_example:
                kind_example[kind] = g
            by_kind.setdefault(kind, []).append(g.id)
        kinds_by_node[node_id] = by_kind
    free_now = {
        node_id: [g for g in gpus if is_free(g)]
        for node_id, gpus in by_node.items()
        if node_id in schedulable
    }
    return PassIndex(
        state=state,
        schedulable_nodes=schedulable,
        node_key=node_key,
        node_rank={
            n: i for i, n in enumerate(sorted(node_key, key=node_key.__getitem__))
        },
        gpus_by_node={k: tuple(v) for k, v in by_node.items()},
        gpu_by_id={g.id: g for g in state.gpus},
        free_now=free_now,
        total_gpus=len(state.gpus),
        running_by_end=tuple(
            sorted(
                state.running,
                key=lambda r: (_planned_end(r, now, predictions, progress), r.id),
            )
        ),
        predictions=predictions,
        progress=progress,
        kind_example=kind_example,
        kinds_by_node=kinds_by_node,
    )
