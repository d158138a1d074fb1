"""Builders shared by the policy test modules (no tests here)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from scheduler.policy import (
    ClassSpec,
    ClusterState,
    GpuView,
    NodeView,
    PendingJob,
    PolicyConfig,
    RunningJob,
    Start,
    Usage,
    Wait,
)

NOW = 1_000_000.0
CLASSES = MappingProxyType(
    {
        "high": ClassSpec("high", 1.0),
        "normal": ClassSpec("normal", 0.5),
        "best-effort": ClassSpec("best-effort", 0.0, preemptible=True),
    }
)
GPULAB = PolicyConfig(name="gpulab")  # backfill plans with limits (the default)
GPULAB_PREDICT = PolicyConfig(name="gpulab", backfill_plan="prediction")
SLURM = PolicyConfig(name="slurm")


def node_gpus(
    node_id: int,
    count: int,
    *,
    mem: int = 81920,
    model: str = "NVIDIA A100-80GB",
    busy: tuple[int, ...] = (),
    nvlink: dict[int, tuple[int, ...]] | None = None,
    levels: dict[tuple[int, int], int] | None = None,
    schedulable: bool = True,
) -> tuple[GpuView, ...]:
    """GPU i of node n has id n*100+i; ``levels`` maps index pairs to NVML levels."""
    out = []
    for i in range(count):
        topo = tuple(
            sorted(
                (b if a == i else a, lvl)
                for (a, b), lvl in (levels or {}).items()
                if i in (a, b)
            )
        )
        out.append(
            GpuView(
                id=node_id * 100 + i,
                node_id=node_id,
                index=i,
                memory_total_mib=mem,
                slots=1,
                free_slots=0 if i in busy else 1,
                schedulable=schedulable,
                model=model,
                nvlink_peers=(nvlink or {}).get(i, ()),
                topology=topo,
            )
        )
    return tuple(out)


def pending(
    job_id: int,
    gpus: int = 1,
    *,
    cls: str = "normal",
    age: float = 0.0,
    planned: float = 3600.0,
    limit: float | None = None,
    group: str = "g",
    user: str = "u",
    mem: int | None = None,
    model: str = "",
) -> PendingJob:
    """``limit`` defaults to ``planned``: backfill plans with the limit, or with
    the prediction (``GPULAB_PREDICT``), so by default every policy plans alike."""
    return PendingJob(
        id=job_id,
        gpus=gpus,
        gpu_memory_mib=mem,
        priority_weight=CLASSES[cls].weight if cls in CLASSES else 0.5,
        submitted_at=NOW - age,
        user=user,
        group=group,
        priority_class=cls,
        gpu_model=model,
        time_limit_s=planned if limit is None else limit,
        planned_s=planned,
    )


def running(
    job_id: int,
    gpu_ids: tuple[int, ...],
    *,
    ends_in: float = 3600.0,
    cls: str = "normal",
    group: str = "g",
    user: str = "u",
    preemptions: int = 0,
    started_ago: float = 600.0,
    limit: float | None = None,
) -> RunningJob:
    return RunningJob(
        id=job_id,
        gpu_ids=gpu_ids,
        started_at=NOW - started_ago,
        planned_s=started_ago + ends_in,
        time_limit_s=started_ago + ends_in if limit is None else limit,
        user=user,
        group=group,
        priority_class=cls,
        preemptible=CLASSES[cls].preemptible if cls in CLASSES else False,
        preemptions_last_hour=preemptions,
    )


def busy_ids(jobs: tuple[RunningJob, ...] | list[RunningJob]) -> set[int]:
    return {g for r in jobs for g in r.gpu_ids}


def cluster(
    gpu_views: tuple[GpuView, ...],
    jobs: list[PendingJob],
    *,
    run: list[RunningJob] | None = None,
    config: PolicyConfig = GPULAB,
    usage: Usage | None = None,
    nodes: list[NodeView] | None = None,
    **config_changes: Any,
) -> ClusterState:
    """A state; GPUs used by ``run`` are marked busy."""
    taken = busy_ids(run or [])
    gpu_views = tuple(
        GpuView(**{**g.__dict__, "free_slots": 0}) if g.id in taken else g
        for g in gpu_views
    )
    node_ids = sorted({g.node_id for g in gpu_views})
    if config_changes:
        config = PolicyConfig(**{**config.__dict__, **config_changes})
    return ClusterState(
        now=NOW,
        nodes=tuple(nodes or [NodeView(n, f"n{n:02d}") for n in node_ids]),
        gpus=gpu_views,
        pending=tuple(jobs),
        running=tuple(run or []),
        usage=usage or Usage(),
        classes=CLASSES,
        config=config,
    )


def starts(decisions: list[Any]) -> dict[int, Start]:
    return {d.job_id: d for d in decisions if isinstance(d, Start)}


def waits(decisions: list[Any]) -> dict[int, Wait]:
    return {d.job_id: d for d in decisions if isinstance(d, Wait)}
