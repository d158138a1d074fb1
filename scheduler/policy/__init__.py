"""The scheduling policy: pure functions from ``ClusterState`` to decisions.

``decide(state)`` dispatches on ``state.config.name``:

- ``fifo``: class weight, then submit order, strict (the first job that does not
  fit blocks every later one); placed like the others, gangs included;
- ``first-fit`` (simulator only, ``SIM_ONLY``): the same order, greedy (later jobs
  start where they fit);
- ``slurm``: Slurm-like multifactor priority + EASY backfill;
- ``gpulab``: the production policy (multifactor, fair share, backfill, preemption,
  topology-aware multi-node placement).

No Django, no I/O, and no decision reads a clock (``run_pass`` times its stages
with ``time.perf_counter`` for ``PassStats`` only): the Celery pass and the
simulator run this code.

Modules (STYLE.md 13): ``state`` (the contract), ``multifactor`` (the pass of
``slurm`` and ``gpulab``: an orchestrator over ``stages``, one function per stage),
``index`` (per-pass lookups), ``ledger`` (free GPUs, bucketed by free count),
``priority`` and ``fairshare`` (the factors), ``place`` (best fit / spread,
topology, gangs), ``colocate`` (sharing a GPU), ``backfill`` (the EASY
reservation), ``preempt`` (the preemption plan), ``reasons`` (messages), ``fifo``
(the baseline).

What the caller must do with the decisions: apply every ``Start`` (in order; each
``Placement`` is one node, rank 0 first, all of them or none), stop every ``Preempt``
victim (SIGTERM, grace, requeue with its age kept, count it in
``preemptions_last_hour``) and leave ``for_job_id`` pending (the next pass starts it
on the freed GPUs), stop every ``QuotaStop`` job (not requeued: a hard quota of it
is used up and ``quota_overrun`` is "stop"), and store each ``Wait``.
"""

from __future__ import annotations

import gc

from scheduler.policy.fifo import order_key, run_fifo
from scheduler.policy.interference import Knowledge, Observations
from scheduler.policy.multifactor import run_multifactor
from scheduler.policy.state import (
    DEFAULT_CLASSES,
    GPULAB_FAMILY,
    ClassSpec,
    ClusterState,
    Decision,
    Dependency,
    Evict,
    GpuView,
    NodeView,
    PassResult,
    PassStats,
    PendingJob,
    Placement,
    PolicyConfig,
    Preempt,
    QuotaStop,
    QuotaView,
    Reason,
    RunningJob,
    Start,
    Usage,
    Wait,
)

# ``gpulab-exclusive``: gpulab that never shares a GPU; ``pack-by-memory``: gpulab
# that shares whenever memory and the job count allow (fraction-based sharing as
# elsewhere): both are co-location baselines. The simulator adds ``oracle``.
POLICIES = ("fifo", "slurm", *GPULAB_FAMILY)
# Pure references the simulator may replay but production settings do not offer.
SIM_ONLY = ("first-fit",)
BACKFILL_PLANS = ("limit", "prediction")


def decide(state: ClusterState) -> list[Decision]:
    """The decisions of one scheduling pass over ``state`` (``run_pass`` without
    its statistics)."""
    return run_pass(state).decisions


def run_pass(state: ClusterState) -> PassResult:
    """One scheduling pass over ``state``: its decisions and its ``PassStats``.

    The cyclic garbage collector is paused for the call: a pass over 10,000 jobs
    allocates tens of thousands of small objects (breakdowns, waits) and no cycles,
    and the collections they trigger cost a third of the time (bench/decide_scaling.py).
    Reference counting still frees everything; the collector resumes afterwards."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _run(state)
    finally:
        if paused:
            gc.enable()


def _run(state: ClusterState) -> PassResult:
    name = state.config.name
    if name == "fifo":
        return run_fifo(state, strict=True)
    if name == "first-fit":
        return run_fifo(state, strict=False)
    if name == "slurm":
        return run_multifactor(
            state,
            preemption=False,
            topology=False,
            predictions=False,
            runtime=False,
            colocation=None,
        )
    if name in GPULAB_FAMILY:
        plan = state.config.backfill_plan
        if plan not in BACKFILL_PLANS:
            raise ValueError(
                f"unknown backfill plan {plan!r}; choose one of"
                f" {', '.join(BACKFILL_PLANS)}"
            )
        return run_multifactor(
            state,
            preemption=True,
            topology=True,
            predictions=state.config.plans_with_prediction,
            runtime=True,
            colocation=(
                None
                if name == "gpulab-exclusive" or not state.config.colocation
                else "memory"
                if name == "pack-by-memory"
                else state.config.colo_rule
            ),
        )
    raise ValueError(
        f"unknown policy {name!r}; choose one of {', '.join((*POLICIES, *SIM_ONLY))}"
    )


__all__ = [
    "BACKFILL_PLANS",
    "DEFAULT_CLASSES",
    "POLICIES",
    "SIM_ONLY",
    "ClassSpec",
    "ClusterState",
    "Decision",
    "Dependency",
    "Evict",
    "GpuView",
    "Knowledge",
    "NodeView",
    "Observations",
    "PassResult",
    "PassStats",
    "PendingJob",
    "Placement",
    "PolicyConfig",
    "Preempt",
    "QuotaStop",
    "QuotaView",
    "Reason",
    "RunningJob",
    "Start",
    "Usage",
    "Wait",
    "decide",
    "order_key",
    "run_pass",
]
