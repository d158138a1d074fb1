"""The ``slurm`` and ``gpulab`` policies: one pass as numbered stages (STYLE.md 13).

1. ``index.build``: every static lookup, once; ``Ledger``: the free GPUs.
2. gate: node-independent refusals (pending jobs arrive PENDING; what is left:
   dependencies not met yet or never (``DEPENDENCY`` / ``DEPENDENCY_NEVER``,
   ``dependency.py``), an array's run-at-once limit reached (``ARRAY_LIMIT``,
   ``arrays.py``), a shape no set of nodes can ever hold: ``NO_SUCH_SHAPE``, and a hard quota used
   up or a concurrent-GPU cap reached: ``QUOTA``, see ``quota.py``; such a job is
   never the top blocked job, never backfilled).
3. ``priority.breakdown``: weighted factors; their sum is the priority.
4. order: priority desc, submitted asc, id asc (reproducible in the simulator).
5. place, in order, until the first job that does not fit (the top blocked job).
6. (co-location: issue #5.)
7/8. reserve for the top blocked job: in ``gpulab``, for a job of a non-preemptible
   class, a preemption plan if one exists (``Preempt`` decisions, the job waits
   ``WAITING_FOR_PREEMPTION`` and the GPUs it will take are reserved from now);
   else the EASY shadow-time reservation (``backfill.reserve``). Then backfill (when
   ``config.backfill``): each later job, at most ``backfill_max_tested`` of them,
   starts if it fits now and either ends by the shadow time or avoids the reserved
   GPUs; the others wait ``RESOURCES`` / ``RESERVED_FOR_HIGHER``, and past the cap
   ``NOT_TESTED``. Without backfill, later jobs wait ``PRIORITY``.
9. reasons: exactly one ``Wait`` per job not started, with its breakdown.

Shape cache: within a pass capacity only shrinks, so when k GPUs of a constraint
fail (single node or gang, with or without the reservation excluded), every later
job of that constraint asking for k or more is refused in O(1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.policy import (
    backfill,
    colocate,
    dependency,
    index,
    place,
    preempt,
    priority,
)
from scheduler.policy.arrays import ArrayLimits
from scheduler.policy.fairshare import FairShare
from scheduler.policy.interference import model_for
from scheduler.policy.ledger import Ledger
from scheduler.policy.quota import Quotas
from scheduler.policy.reasons import Messages, duration, gpus_word, when
from scheduler.policy.state import (
    Evict,
    Placement,
    Preempt,
    Reason,
    RunningJob,
    Start,
    Wait,
)

if TYPE_CHECKING:
    from scheduler.policy.backfill import Reservation
    from scheduler.policy.colocate import Estimator
    from scheduler.policy.index import Constraint
    from scheduler.policy.state import ClusterState, Decision, PendingJob

INF = 1 << 62


def decide_multifactor(
    state: ClusterState,
    *,
    preemption: bool,
    topology: bool,
    predictions: bool,
    runtime: bool,
    colocation: str | None = None,
    estimator: Estimator | None = None,
) -> list[Decision]:
    """``predictions``: backfill plans jobs with min(limit, prediction), not their
    limits; ``runtime``: the run-time priority factor (and class tie-break);
    ``colocation``: None (never share), "full" (rules 1-4) or "memory" (memory and
    count only); ``estimator``: predicts slowdowns (default: ``interference.Model``
    over ``state.knowledge``; the simulator's oracle reads the true table)."""
    cfg = state.config
    spread = cfg.placement == "spread"
    now = state.now

    # 1. index and ledger
    idx = index.build(state, predictions=predictions)
    ledger = Ledger({n: gs.copy() for n, gs in idx.free_now.items()}, idx.node_rank)
    quotas = Quotas(state.quotas, cfg.quota_soft_factor)
    arrays = ArrayLimits(state.running)
    fairshare = FairShare(
        state.usage,
        {j.group for j in state.pending} | {r.group for r in state.running},
        {(j.group, j.user) for j in state.pending}
        | {(r.group, r.user) for r in state.running},
        quotas.fairshare_scale if quotas else None,
    )
    messages = Messages(idx)

    # 6 (set-up). co-location: first the later jobs of pairs measured over a cap
    # go back to the queue, then the GPUs others may join
    evicts: list[Decision] = []
    sharing: colocate.Sharing | None = None
    if colocation is not None and cfg.colocation:
        if colocation == "full":
            evicts = list(colocate.evictions(state))
        sharing = colocate.Sharing(
            state,
            idx,
            estimator or model_for(state.knowledge),
            colocation,
            frozenset(e.job_id for e in evicts if isinstance(e, Evict)),
        )
    pack_first = cfg.colo_packing == "pack"

    # 3. priority breakdown
    breakdowns, prio = priority.breakdowns(
        state.pending,
        now=now,
        config=cfg,
        classes=state.classes,
        fairshare=fairshare,
        total_gpus=idx.total_gpus,
        runtime=runtime,
    )

    # 4. stable order (tuples compare in C; the position breaks nothing: ids are unique)
    pending = state.pending
    # gpulab: at equal priority the higher class first (a max-aged job's whole
    # runtime part may tie a new job one class up: see priority.py), then older
    keyed = sorted(
        (
            -prio[j.id],
            -breakdowns[j.id]["class"] if runtime else 0.0,
            j.submitted_at,
            j.id,
            i,
        )
        for i, j in enumerate(pending)
    )
    order = [pending[k[4]] for k in keyed]

    decisions: list[Decision] = evicts
    if quotas and cfg.quota_overrun == "stop":
        decisions.extend(quotas.overruns(state.running))
    started: list[RunningJob] = []
    failed: dict[tuple[bool, bool, Constraint], int] = {}
    reservation: Reservation | None = None
    top: PendingJob | None = None
    tested = 0

    def try_place(
        job: PendingJob, c: Constraint, *, avoid_reserved: bool
    ) -> tuple[Placement, ...] | None:
        gang = place.is_gang(idx, c, job.gpus)
        key = (gang, avoid_reserved, c)
        if failed.get(key, INF) <= job.gpus:
            return None
        exclude = (
            reservation.gpu_ids
            if avoid_reserved and reservation is not None
            else place.NO_EXCLUSION
        )
        got = place.place(
            ledger, idx, c, job.gpus, exclude=exclude, spread=spread, topology=topology
        )
        if got is None:
            failed[key] = min(failed.get(key, INF), job.gpus)
        return got

    def start(job: PendingJob, placements: tuple[Placement, ...], *, bf: bool) -> None:
        place.take(ledger, placements)
        gpu_ids = tuple(g for p in placements for g in p.gpu_ids)
        started.append(
            RunningJob(job.id, gpu_ids, now, job.planned_s, job.time_limit_s)
        )
        decisions.append(Start(job.id, placements, backfilled=bf))
        if quotas:
            quotas.take(job)
        arrays.take(job)
        if sharing is not None and job.shareable and len(gpu_ids) == 1:
            sharing.started_alone(job, gpu_ids[0])

    refusals: dict[int, str] = {}

    def share(job: PendingJob, c: Constraint, *, bf: bool, avoid: bool) -> bool:
        """Stage 6: start ``job`` on a GPU it shares, if one admits it; ``avoid``:
        not on GPUs the reservation holds."""
        if sharing is None or job.gpus != 1 or not job.shareable:
            return False
        exclude = (
            reservation.gpu_ids
            if avoid and reservation is not None
            else place.NO_EXCLUSION
        )
        adm, refusal = sharing.try_share(job, c, exclude)
        if adm is None:
            if refusal is not None:
                refusals[job.id] = f"; sharing a GPU refused: {refusal.message}"
            return False
        gpu = idx.gpu_by_id[adm.gpu_id]
        started.append(
            RunningJob(job.id, (adm.gpu_id,), now, job.planned_s, job.time_limit_s)
        )
        decisions.append(
            Start(
                job.id,
                (Placement(gpu.node_id, (adm.gpu_id,)),),
                backfilled=bf,
                admission=adm,
            )
        )
        if quotas:
            quotas.take(job)
        arrays.take(job)
        return True

    # 9. reasons are rendered after the last start, against the final ledger
    later: list[
        tuple[PendingJob, Reason, str, float | None, tuple[Constraint, int] | None]
    ] = []

    def wait(
        job: PendingJob,
        reason: Reason,
        message: str,
        est: float | None = None,
        *,
        resources: tuple[Constraint, int] | None = None,
    ) -> None:
        """``resources``: prefix the message with the shape's free-GPU histogram."""
        later.append((job, reason, message, est, resources))

    # per shape (gpus, memory, model): its constraint and whether any set of nodes
    # could ever hold it, looked up once per shape, not once per job
    shapes: dict[tuple[int, int | None, str], tuple[Constraint, bool]] = {}
    not_tested = (
        f"not tested this pass: backfill stopped after"
        f" {cfg.backfill_max_tested} jobs (backfill_max_tested)"
    )
    max_tested = cfg.backfill_max_tested
    not_tested_reason = Reason.NOT_TESTED
    for job in order:
        sk = (job.gpus, job.gpu_memory_mib, job.gpu_model)
        got_shape = shapes.get(sk)
        if got_shape is None:
            c0 = idx.constraint(job)
            got_shape = shapes[sk] = (c0, place.could_ever(idx, c0, job.gpus))
        c, ok = got_shape
        # 2. gate
        if job.dependencies:
            blocked = dependency.refusal(job)
            if blocked is not None:
                wait(job, *blocked)
                continue
        if job.array_limit is not None:
            limited = arrays.refusal(job)
            if limited is not None:
                wait(job, Reason.ARRAY_LIMIT, limited)
                continue
        if not ok:
            wait(job, Reason.NO_SUCH_SHAPE, messages.no_such_shape(c, job.gpus))
            continue
        if quotas:
            refused = quotas.refusal(job, now)
            if refused is not None:
                wait(job, Reason.QUOTA, refused)
                continue

        # 5. place in order until the first job that does not fit (6: a shareable
        # job shares a GPU when none is free, or first when packing)
        if top is None:
            if pack_first and share(job, c, bf=False, avoid=False):
                continue
            got = try_place(job, c, avoid_reserved=False)
            if got is not None:
                start(job, got, bf=False)
                continue
            if not pack_first and share(job, c, bf=False, avoid=False):
                continue
            # 7/8. the top blocked job: preemption plan or shadow-time reservation
            top = job
            plan = None
            spec = state.classes.get(job.priority_class)
            if preemption and not (spec is not None and spec.preemptible):
                plan = preempt.plan(
                    c,
                    job.gpus,
                    ledger,
                    idx,
                    fairshare,
                    spread=spread,
                    topology=topology,
                )
            if plan is not None:
                victims, placements = plan.victims, plan.placements
                held = tuple(v.id for v in victims) + plan.waiting_on
                reservation = backfill.Reservation(
                    job.id,
                    now,
                    placements,
                    frozenset(g for p in placements for g in p.gpu_ids),
                    None,
                    held,
                )
                for v in victims:
                    decisions.append(
                        Preempt(
                            v.id,
                            job.id,
                            f"preempted (class {v.priority_class!r}) so that job"
                            f" {job.id} (class {job.priority_class!r}) can start",
                        )
                    )
                nodes = ", ".join(
                    idx.node_key.get(p.node_id, ("", p.node_id))[0] or str(p.node_id)
                    for p in placements
                )
                parts = []
                if victims:
                    parts.append(
                        "stopping preemptible job(s) "
                        + ", ".join(str(v.id) for v in victims)
                    )
                if plan.waiting_on:
                    parts.append(
                        "waiting for job(s) "
                        + ", ".join(map(str, plan.waiting_on))
                        + " (already being stopped)"
                    )
                wait(
                    job,
                    Reason.WAITING_FOR_PREEMPTION,
                    f"{' and '.join(parts)} to free {gpus_word(job.gpus)} on {nodes};"
                    " it starts when they exit",
                )
                continue
            reservation = backfill.reserve(
                job.id,
                c,
                job.gpus,
                ledger,
                idx,
                [*idx.running_by_end, *started],
                spread=spread,
                topology=topology,
            )
            if reservation.shadow is None:
                msg = (
                    "; no start can be planned from the running jobs"
                    " (it needs GPUs that are down, draining or not tracked)"
                )
            else:
                msg = f"; reserved to start at {when(reservation.shadow, now)}"
                if reservation.behind is not None:
                    msg += f", when job {reservation.behind} is planned to end"
            wait(
                job,
                Reason.RESOURCES,
                msg,
                reservation.shadow,
                resources=(c, job.gpus),
            )
            continue

        # after the top blocked job
        assert reservation is not None
        if not cfg.backfill:
            wait(
                job,
                Reason.PRIORITY,
                f"behind job {top.id} (priority {prio[top.id]:.0f}, this job"
                f" {prio[job.id]:.0f}), which waits for GPUs; backfill is off",
            )
            continue
        if tested >= max_tested:
            later.append((job, not_tested_reason, not_tested, None, None))
            continue
        tested += 1
        if pack_first and share(job, c, bf=True, avoid=True):
            continue
        got = try_place(job, c, avoid_reserved=False)
        if got is None:
            if not pack_first and share(job, c, bf=True, avoid=True):
                continue
            wait(
                job,
                Reason.RESOURCES,
                # Not named: the holder changes with nearly every start, and
                # naming it rewrote most waiting rows on each pass (the queue
                # and the job's page show the jobs ahead).
                "; the first job ahead of it that waits for GPUs holds the reservation",
                resources=(c, job.gpus),
            )
            continue
        shadow = reservation.shadow
        if shadow is None and not reservation.victims:
            start(job, got, bf=True)  # nothing can be protected: no planned start
            continue
        if shadow is not None and now + idx.planned_s(job) <= shadow:
            start(job, got, bf=True)
            continue
        got = try_place(job, c, avoid_reserved=True)
        if got is not None:
            start(job, got, bf=True)
            continue
        if not pack_first and share(job, c, bf=True, avoid=True):
            continue
        if reservation.victims:
            msg = (
                f"{gpus_word(job.gpus)} are free now, but they are held for job"
                f" {top.id}, which is preempting job(s)"
                f" {', '.join(map(str, reservation.victims))}"
            )
        else:
            assert shadow is not None
            msg = (
                f"{gpus_word(job.gpus)} are free now, but it would delay job {top.id},"
                f" reserved to start at {when(shadow, now)}: it is planned to run"
                f" {duration(idx.planned_s(job))}, past that, and the only GPUs that fit"
                f" it are reserved"
            )
        wait(job, Reason.RESERVED_FOR_HIGHER, msg)

    # 9. exactly one Wait per job not started, in scheduling order
    # (``_wait`` inlined: this loop runs once per waiting job, up to 10,000)
    append = decisions.append
    new = object.__new__
    for position, (job, reason, message, est, res) in enumerate(later, 1):
        if res is not None:
            message = f"{messages.resources(*res, ledger)}{message}"
        if refusals and job.id in refusals:
            message += refusals[job.id]
        w = new(Wait)
        fields = w.__dict__  # frozen: set the fields as dataclasses' __init__ does
        fields["job_id"] = job.id
        fields["reason"] = reason
        fields["message"] = message
        fields["position"] = position
        fields["breakdown"] = breakdowns[job.id]
        fields["est_start"] = est
        append(w)
    return decisions
