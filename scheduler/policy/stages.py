"""The stages of a ``slurm`` / ``gpulab`` pass over one ``Pass`` context.

``multifactor.run_multifactor`` runs them in this order (``state.STAGES``):

- ``setup``: ``index.build`` (every static lookup, once), the ``Ledger`` of free
  GPUs, quotas, array limits, fair share; then ``stop_overruns`` (``QuotaStop``);
- ``colocation``: ``share_setup`` (the later jobs of pairs measured over a cap go
  back to the queue, then the GPUs others may join), and later every ``share``;
- ``ordering``: ``ordering`` (weighted factors; priority desc, then the higher
  class in ``gpulab``, submitted asc, id asc);
- ``placement``: ``place_in_order``: each job passes ``gate`` (dependencies, array
  limit, a shape no set of nodes can ever hold, quota) and starts (``try_place``,
  ``start``, or ``share``) until the first job that does not fit: the top blocked
  job;
- ``reservation``: ``reserve_top``: for the top blocked job, in ``gpulab`` and a
  non-preemptible class, a preemption plan if one exists (``preempt_for``):
  victims by class first, then guests (``preempt.guests``), else checkpointable
  jobs by least attained service (``preempt.las_candidates``); else the EASY
  shadow-time reservation (``reserve_shadow``; a guest's GPUs count as freeing
  when its minimum run ends);
- ``backfill``: ``backfill``: each later job, at most ``backfill_max_tested`` of
  them, starts if it fits now and either ends by the shadow time or avoids the
  reserved GPUs, else (``gpulab``, up to ``las_extra_plans`` a pass) may get a
  preemption plan by attained service of its own (``las_extra``), else (with
  ``guest_backfill``, a checkpointable job) starts on the reserved GPUs as a
  guest (``Start.guest``), which the top blocked job preempts when it can start;
  without backfill later jobs wait ``PRIORITY``;
- ``reasons``: ``render_waits``: exactly one ``Wait`` per job not started, in
  scheduling order, against the final ledger.

Shape cache: within a pass capacity only shrinks, so when k GPUs of a constraint
fail (single node or gang, with or without the reservation excluded), every later
job of that constraint asking for k or more is refused in O(1).
"""

from __future__ import annotations

import time
from math import isnan
from typing import TYPE_CHECKING

from scheduler.policy import backfill as easy
from scheduler.policy import (
    colocate,
    dependency,
    index,
    place,
    preempt,
    priority,
    wait_bound,
)
from scheduler.policy.arrays import ArrayLimits
from scheduler.policy.fairshare import FairShare
from scheduler.policy.interference import model_for
from scheduler.policy.ledger import Ledger
from scheduler.policy.quota import Quotas
from scheduler.policy.reasons import Messages, duration, gpus_word, when
from scheduler.policy.state import (
    STAGE_COLOCATION,
    STOP_BACKFILL_MAX_TESTED,
    STOP_BACKFILL_OFF,
    STOP_QUEUE_EXHAUSTED,
    Evict,
    Placement,
    Preempt,
    Reason,
    RunningJob,
    Start,
    Wait,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from scheduler.policy.backfill import Reservation
    from scheduler.policy.colocate import Estimator
    from scheduler.policy.index import Constraint, PassIndex
    from scheduler.policy.state import ClusterState, Decision, PendingJob, PolicyConfig

INF = 1 << 62

# a job's Wait before rendering: (job, reason, message, planned start, the shape
# whose free-GPU histogram prefixes the message)
Later = tuple["PendingJob", Reason, str, float | None, "tuple[Constraint, int] | None"]


class Pass:
    """What the stages of one pass share: the state, the lookups, the free GPUs,
    and what the pass decided so far. Built by ``setup``; every stage reads and
    extends it, none keeps anything across passes."""

    def __init__(
        self,
        state: ClusterState,
        *,
        preemption: bool,
        topology: bool,
        predictions: bool,
        runtime: bool,
    ) -> None:
        cfg = state.config
        self.state = state
        self.cfg: PolicyConfig = cfg
        self.now = state.now
        self.preemption = preemption
        self.topology = topology
        self.runtime = runtime
        self.spread = cfg.placement == "spread"
        self.pack_first = cfg.colo_packing == "pack"
        self.idx: PassIndex = index.build(state, predictions=predictions)
        self.ledger = Ledger(
            {n: gs.copy() for n, gs in self.idx.free_now.items()}, self.idx.node_rank
        )
        self.quotas = Quotas(state.quotas, cfg.quota_soft_factor)
        # fixed for the pass (the quota book's quotas never change): tested once
        # here, not once per job at the gate
        self.has_quotas = bool(self.quotas)
        self.arrays = ArrayLimits(state.running)
        users = {(j.group, j.user) for j in state.pending} | {
            (r.group, r.user) for r in state.running
        }
        self.fairshare = FairShare(
            state.usage,
            {g for g, _ in users},
            users,
            self.quotas.fairshare_scale if self.has_quotas else None,
            # ``slurm`` weighs users as Slurm's multifactor plugin does
            cfg.fairshare_user if runtime else 1.0,
        )
        self.messages = Messages(self.idx)
        self.sharing: colocate.Sharing | None = None
        self.decisions: list[Decision] = []
        self.started: list[RunningJob] = []
        # (gang, reservation avoided, constraint) -> fewest GPUs that failed
        self.failed: dict[tuple[bool, bool, Constraint], int] = {}
        # per shape (gpus, memory, model): its constraint and whether any set of
        # nodes could ever hold it, looked up once per shape, not once per job
        self.shapes: dict[tuple[int, int | None, str], tuple[Constraint, bool]] = {}
        self.refusals: dict[int, str] = {}  # job -> why sharing was refused
        self.later: list[Later] = []
        self.breakdowns: dict[int, dict[str, float]] = {}
        self.prio: dict[int, float] = {}
        self.top: PendingJob | None = None
        self.reservation: Reservation | None = None
        # preemption plans by attained service beyond the top blocked job's
        # (``las_extra``): how many are left, the victims and GPUs plans of this
        # pass took, the candidates per (interactive, class weight, the job's plan
        # under ``las_shorter``), and per (constraint, candidates) the fewest GPUs
        # no plan could free
        self.las_left = cfg.las_extra_plans if preemption and cfg.las_preemption else 0
        self.las_victims: set[int] = set()
        self.held: set[int] = set()
        self.las_pool: dict[tuple[bool, float, float], list[RunningJob]] = {}
        self.las_failed: dict[tuple[Constraint, bool, float, float], int] = {}
        self.reserved = 0
        self.tested = 0
        self.stop_reason = STOP_QUEUE_EXHAUSTED
        self.stage_s: dict[str, float] = {}

    def wait(
        self,
        job: PendingJob,
        reason: Reason,
        message: str,
        est: float | None = None,
        *,
        resources: tuple[Constraint, int] | None = None,
    ) -> None:
        """``job`` waits; ``resources``: prefix the message with the shape's
        free-GPU histogram (rendered by ``render_waits`` after the last start)."""
        self.later.append((job, reason, message, est, resources))

    def exclusion(self, avoid_reserved: bool) -> frozenset[int]:  # noqa: FBT001
        """The GPUs a start must avoid: the reservation's, when asked."""
        if avoid_reserved and self.reservation is not None:
            return self.reservation.gpu_ids
        return place.NO_EXCLUSION


# ------------------------------------------------------------------ setup


def stop_overruns(p: Pass) -> None:
    """``QuotaStop`` for each running job over a used-up hard quota, when
    ``quota_overrun`` is "stop"."""
    if p.quotas and p.cfg.quota_overrun == "stop":
        p.decisions.extend(p.quotas.overruns(p.state.running))


def share_setup(p: Pass, rules: str | None, estimator: Estimator | None) -> None:
    """Co-location set-up: ``Evict`` the later job of each pair measured over a cap
    (``rules`` "full"), then index the GPUs others may join. ``rules`` None (or
    ``config.colocation`` off): nothing is shared this pass."""
    if rules is None or not p.cfg.colocation:
        return
    state = p.state
    evicts = colocate.evictions(state) if rules == "full" else []
    p.decisions.extend(evicts)
    p.sharing = colocate.Sharing(
        state,
        p.idx,
        estimator or model_for(state.knowledge),
        rules,
        frozenset(e.job_id for e in evicts if isinstance(e, Evict)),
    )


# ------------------------------------------------------------------ ordering


def ordering(p: Pass) -> list[PendingJob]:
    """The pending jobs in scheduling order: interactive jobs first, then
    priority desc, then (``runtime``) the higher class, submitted asc, id asc
    (``gpulab``: ``preempt.las_order`` then moves lower-queue resumed work, and
    ``wait_bound.bound_order`` puts the jobs that waited over ``max_wait_s``,
    or over ``preempted_max_wait_s`` since a preemption, ahead of their class and
    below). Fills ``p.breakdowns`` and ``p.prio``."""
    state = p.state
    p.breakdowns, p.prio = breakdowns, prio = priority.breakdowns(
        state.pending,
        now=p.now,
        config=p.cfg,
        classes=state.classes,
        fairshare=p.fairshare,
        total_gpus=p.idx.total_gpus,
        runtime=p.runtime,
    )
    pending = state.pending
    # interactive jobs (``ClassSpec.interactive``) ahead of batch work
    interactive = {n for n, spec in state.classes.items() if spec.interactive}
    order = scheduling_order(
        pending,
        [prio[j.id] for j in pending],
        (lambda j: breakdowns[j.id]["class"]) if p.runtime else None,
        interactive,
    )
    if p.preemption and p.cfg.las_preemption:
        order = preempt.las_order(p, order)
    if p.runtime and (p.cfg.max_wait_s > 0 or p.cfg.preempted_max_wait_s > 0):
        order = wait_bound.bound_order(
            order,
            p.now,
            p.cfg.max_wait_s,
            lambda j: breakdowns[j.id]["class"],
            interactive,
            p.cfg.preempted_max_wait_s,
        )
    return order


def scheduling_order(
    pending: Sequence[PendingJob],
    prio: list[float],
    class_part: Callable[[PendingJob], float] | None,
    interactive: set[str],
) -> list[PendingJob]:
    """``pending`` sorted by (not interactive, priority desc, ``class_part``
    desc when given, submitted asc, id asc, position); ``prio`` is per job, in
    ``pending``'s order.

    The same order as sorting those tuples, at a fraction of the cost: jobs are
    sorted by priority alone (a list of floats sorts in C without tuple
    comparisons), the rare runs of equal priority are sorted by the rest of the
    key, and interactive jobs are moved ahead keeping their order. A NaN
    priority (it compares unequal to itself) falls back to the tuple sort."""
    n = len(pending)
    if any(map(isnan, prio)):
        keyed = sorted(
            (
                j.priority_class not in interactive,
                -prio[i],
                -class_part(j) if class_part is not None else 0.0,
                j.submitted_at,
                j.id,
                i,
            )
            for i, j in enumerate(pending)
        )
        return [pending[k[5]] for k in keyed]
    # descending, equal priorities in any order: they are sorted below
    idx = sorted(range(n), key=prio.__getitem__, reverse=True)
    ranked = [prio[i] for i in idx]
    if len(set(ranked)) < n:
        k = 0
        while k < n:
            e = k + 1
            v = ranked[k]
            while e < n and ranked[e] == v:
                e += 1
            if e - k > 1:
                idx[k:e] = sorted(
                    idx[k:e],
                    key=lambda i: (
                        -class_part(pending[i]) if class_part is not None else 0.0,
                        pending[i].submitted_at,
                        pending[i].id,
                        i,
                    ),
                )
            k = e
    order = [pending[i] for i in idx]
    if interactive and any(j.priority_class in interactive for j in order):
        first = [j for j in order if j.priority_class in interactive]
        order = first + [j for j in order if j.priority_class not in interactive]
    return order


# ------------------------------------------------------------------ placement


def gate(p: Pass, job: PendingJob) -> Constraint | None:
    """``job``'s constraint, or None when a node-independent rule holds it (it then
    waits: ``DEPENDENCY`` / ``DEPENDENCY_NEVER``, ``ARRAY_LIMIT``,
    ``NO_SUCH_SHAPE`` or ``QUOTA``; such a job is never the top blocked job and
    never backfilled)."""
    sk = (job.gpus, job.gpu_memory_mib, job.gpu_model)
    got = p.shapes.get(sk)
    if got is None:
        c0 = p.idx.constraint(job)
        got = p.shapes[sk] = (c0, place.could_ever(p.idx, c0, job.gpus))
    c, ok = got
    if job.dependencies:
        blocked = dependency.refusal(job)
        if blocked is not None:
            p.wait(job, *blocked)
            return None
    if job.array_limit is not None:
        limited = p.arrays.refusal(job)
        if limited is not None:
            p.wait(job, Reason.ARRAY_LIMIT, limited)
            return None
    if not ok:
        p.wait(job, Reason.NO_SUCH_SHAPE, p.messages.no_such_shape(c, job.gpus))
        return None
    if p.has_quotas:
        refused = p.quotas.refusal(job, p.now)
        if refused is not None:
            p.wait(job, Reason.QUOTA, refused)
            return None
    return c


def try_place(
    p: Pass, job: PendingJob, c: Constraint, *, avoid_reserved: bool
) -> tuple[Placement, ...] | None:
    """Where ``job`` fits on the free GPUs now (not on the reserved ones when
    ``avoid_reserved``), or None; a miss is remembered for the shape cache."""
    gang = place.is_gang(p.idx, c, job.gpus)
    key = (gang, avoid_reserved, c)
    failed = p.failed
    if failed.get(key, INF) <= job.gpus:
        return None
    got = place.place(
        p.ledger,
        p.idx,
        c,
        job.gpus,
        exclude=p.exclusion(avoid_reserved),
        spread=p.spread,
        topology=p.topology,
    )
    if got is None:
        failed[key] = min(failed.get(key, INF), job.gpus)
    return got


def _record_start(p: Pass, job: PendingJob, start: Start) -> None:
    gpu_ids = start.gpu_ids
    p.started.append(
        RunningJob(
            job.id, gpu_ids, p.now, job.planned_s, job.time_limit_s, guest=start.guest
        )
    )
    p.decisions.append(start)
    if p.has_quotas:
        p.quotas.take(job)
    p.arrays.take(job)


def start(
    p: Pass,
    job: PendingJob,
    placements: tuple[Placement, ...],
    *,
    bf: bool,
    guest: bool = False,
) -> None:
    """Start ``job`` on ``placements`` (whole GPUs) and take them from the ledger;
    a shareable single-GPU job's GPU becomes one a later job may join."""
    place.take(p.ledger, placements)
    _record_start(p, job, Start(job.id, placements, backfilled=bf, guest=guest))
    gpu_ids = tuple(g for pl in placements for g in pl.gpu_ids)
    if p.sharing is not None and job.shareable and len(gpu_ids) == 1:
        p.sharing.started_alone(job, gpu_ids[0])


def share(p: Pass, job: PendingJob, c: Constraint, *, bf: bool, avoid: bool) -> bool:
    """Start ``job`` on a GPU it shares, if one admits it (``colocate``); ``avoid``:
    not on GPUs the reservation holds. A refusal is kept for its ``Wait``."""
    sharing = p.sharing
    if sharing is None or job.gpus != 1 or not job.shareable:
        return False
    t0 = time.perf_counter()
    adm, refusal = sharing.try_share(job, c, p.exclusion(avoid))
    if adm is None:
        if refusal is not None:
            p.refusals[job.id] = f"; sharing a GPU refused: {refusal.message}"
    else:
        gpu = p.idx.gpu_by_id[adm.gpu_id]
        placements = (Placement(gpu.node_id, (adm.gpu_id,)),)
        _record_start(p, job, Start(job.id, placements, backfilled=bf, admission=adm))
    stage_s = p.stage_s
    stage_s[STAGE_COLOCATION] = (
        stage_s.get(STAGE_COLOCATION, 0.0) + time.perf_counter() - t0
    )
    return adm is not None


def place_in_order(
    p: Pass, order: Sequence[PendingJob]
) -> tuple[int, Constraint | None]:
    """Start jobs in order until the first that passes the gate and does not fit
    (a shareable job shares a GPU when none is free, or first when packing). The
    answer is that job's position in ``order`` and its constraint (``len(order)``
    and None: none blocked)."""
    pack_first = p.pack_first
    for i, job in enumerate(order):
        c = gate(p, job)
        if c is None:
            continue
        if pack_first and share(p, job, c, bf=False, avoid=False):
            continue
        got = try_place(p, job, c, avoid_reserved=False)
        if got is not None:
            start(p, job, got, bf=False)
            continue
        if not pack_first and share(p, job, c, bf=False, avoid=False):
            continue
        return i, c
    return len(order), None


# ------------------------------------------------------------------ reservation


def _plan(
    p: Pass,
    job: PendingJob,
    c: Constraint,
    cands: list[RunningJob] | None = None,
    held: frozenset[int] = frozenset(),
) -> preempt.Plan | None:
    """``preempt.plan`` for ``job`` on this pass's ledger, index, fair share and
    placement, among ``cands`` (None: the preemptible class's jobs), not on
    ``held`` GPUs."""
    return preempt.plan(
        c,
        job.gpus,
        p.ledger,
        p.idx,
        p.fairshare,
        spread=p.spread,
        topology=p.topology,
        cands=cands,
        held=held,
    )


def reserve_top(p: Pass, job: PendingJob, c: Constraint) -> None:
    """``job`` is the top blocked job: a preemption plan (``gpulab``, a job of a
    non-preemptible class) when one exists, else the EASY reservation."""
    p.top = job
    spec = p.state.classes.get(job.priority_class)
    if p.preemption and not (spec is not None and spec.preemptible):
        plan = _plan(p, job, c)
        if plan is None and _guests_yield(p, job):
            cands = preempt.guests(p.idx)
            if cands:
                plan = _plan(p, job, c, cands=cands)
        if plan is None and p.cfg.las_preemption:
            plan = _plan(p, job, c, cands=preempt.las_candidates(p.idx, job))
        if plan is not None:
            preempt_for(p, job, plan)
            return
    reserve_shadow(p, job, c)


def preempt_for(p: Pass, job: PendingJob, plan: preempt.Plan) -> None:
    """Apply ``plan``: ``Preempt`` its victims; ``job`` waits
    ``WAITING_FOR_PREEMPTION`` and the GPUs it will take are reserved from now."""
    placements = plan.placements
    p.reservation = easy.Reservation(
        job.id,
        p.now,
        placements,
        frozenset(g for pl in placements for g in pl.gpu_ids),
        None,
        tuple(v.id for v in plan.victims) + plan.waiting_on,
    )
    p.reserved += 1
    _apply_plan(p, job, plan)


def las_extra(p: Pass, job: PendingJob, c: Constraint) -> bool:
    """A preemption plan by attained service for ``job``, a waiting job after the
    top blocked one that cannot start now (``backfill_one``), as Tiresias gives
    every waiting top-queue job: at most ``las_extra_plans`` per pass, with the
    guards of ``preempt.las_candidates``, never on the GPUs the reservation or an
    earlier plan of the pass holds, never with an earlier plan's victims. True
    when it got one (it then waits ``WAITING_FOR_PREEMPTION``); its free GPUs
    leave the ledger, so no later job takes them."""
    if p.las_left <= 0:
        return False
    spec = p.state.classes.get(job.priority_class)
    if spec is not None and spec.preemptible:
        return False
    interactive = spec is not None and spec.interactive
    if not interactive and not preempt.top_queue(job, p.cfg):
        return False
    pool_key = (
        interactive,
        spec.weight if spec is not None else 0.0,
        # ``las_shorter``: the candidates depend on the job's plan too
        job.planned_s if p.cfg.las_shorter and not interactive else 0.0,
    )
    cands = p.las_pool.get(pool_key)
    if cands is None:
        cands = p.las_pool[pool_key] = preempt.las_candidates(p.idx, job)
    if p.las_victims:
        cands = [r for r in cands if r.id not in p.las_victims]
    fail_key = (c, *pool_key)
    if p.las_failed.get(fail_key, INF) <= job.gpus:
        return False
    held = set(p.held)
    if p.reservation is not None:
        held |= p.reservation.gpu_ids
    plan = _plan(p, job, c, cands=cands, held=frozenset(held))
    if plan is None:
        p.las_failed[fail_key] = min(p.las_failed.get(fail_key, INF), job.gpus)
        return False
    if plan.victims:
        p.las_left -= 1
    for pl in plan.placements:
        free = {g.id for g in p.ledger.free.get(pl.node_id, ())}
        mine = [g for g in pl.gpu_ids if g in free]
        if mine:
            p.ledger.take(pl.node_id, mine)
    p.reserved += 1
    _apply_plan(p, job, plan)
    return True


def _apply_plan(p: Pass, job: PendingJob, plan: preempt.Plan) -> None:
    """``Preempt`` ``plan``'s victims for ``job``, which waits
    ``WAITING_FOR_PREEMPTION``; its victims and GPUs are the pass's from now."""
    victims, placements = plan.victims, plan.placements
    p.las_victims.update(v.id for v in victims)
    p.held.update(g for pl in placements for g in pl.gpu_ids)
    classes = p.state.classes
    for v in victims:
        spec = classes.get(v.priority_class)
        if spec is not None and spec.preemptible:
            why = (
                f"preempted (class {v.priority_class!r}) so that job"
                f" {job.id} (class {job.priority_class!r}) can start"
            )
        elif v.guest:
            why = (
                f"preempted (checkpointable, started as a guest on GPUs held for"
                f" the first job waiting) so that job {job.id} can start"
            )
        else:
            why = (
                f"preempted (checkpointable, {_gpu_h(v.attained_gpu_s(p.now))}"
                f" attained) so that job {job.id}"
                f" ({_gpu_h(job.attained_gpu_s)} attained) can start:"
                " least attained service first"
            )
        p.decisions.append(Preempt(v.id, job.id, why))
    node_key = p.idx.node_key
    nodes = ", ".join(
        node_key.get(pl.node_id, ("", pl.node_id))[0] or str(pl.node_id)
        for pl in placements
    )
    parts = []
    if victims:
        by_class = all(
            (spec := classes.get(v.priority_class)) is not None and spec.preemptible
            for v in victims
        )
        parts.append(
            f"stopping {'preemptible' if by_class else 'checkpointable'} job(s) "
            + ", ".join(str(v.id) for v in victims)
        )
    if plan.waiting_on:
        parts.append(
            "waiting for job(s) "
            + ", ".join(map(str, plan.waiting_on))
            + " (already being stopped)"
        )
    p.wait(
        job,
        Reason.WAITING_FOR_PREEMPTION,
        f"{' and '.join(parts)} to free {gpus_word(job.gpus)} on {nodes};"
        " it starts when they exit",
    )


def _gpu_h(gpu_s: float) -> str:
    return f"{gpu_s / 3600.0:.1f} GPU-h"


def _guests_yield(p: Pass, job: PendingJob) -> bool:
    """Guests are on and ``job``, the top blocked job, may preempt them (the
    ``gpulab`` policy, a job of a non-preemptible class: ``reserve_top``)."""
    if p.cfg.guest_backfill == "off" or not p.preemption:
        return False
    spec = p.state.classes.get(job.priority_class)
    return not (spec is not None and spec.preemptible)


def reserve_shadow(p: Pass, job: PendingJob, c: Constraint) -> None:
    """The EASY reservation (``backfill.reserve``): ``job`` waits ``RESOURCES``
    with its planned start, if the running jobs' planned ends give one.

    The start shown to ``job`` (its ``Wait``'s ``est_start`` and message) is
    planned again with ``PassIndex.shown_end`` when some running job's end comes
    from progress: a promise keeps a margin over an estimate that is as often
    late as early. The reservation the pass decides with keeps the
    ``planned_end`` shadow time."""
    idx = p.idx
    running = [*idx.running_by_end, *p.started]
    # with guests, the GPUs a guest holds free when it may first be preempted
    end_of = preempt.guest_end(idx) if _guests_yield(p, job) else None
    r = p.reservation = easy.reserve(
        job.id,
        c,
        job.gpus,
        p.ledger,
        idx,
        running,
        spread=p.spread,
        topology=p.topology,
        end_of=end_of,
    )
    shown, behind = r.shadow, r.behind
    if shown is None:
        msg = (
            "; no start can be planned from the running jobs"
            " (it needs GPUs that are down, draining or not tracked)"
        )
    else:
        p.reserved += 1
        if idx.progress and any(x.progress is not None for x in idx.running_by_end):
            s = easy.reserve(
                job.id,
                c,
                job.gpus,
                p.ledger,
                idx,
                running,
                spread=p.spread,
                topology=p.topology,
                end_of=idx.shown_end,
            )
            if s.shadow is not None and s.shadow > shown:
                shown, behind = s.shadow, s.behind
        msg = f"; reserved to start at {when(shown, p.now)}"
        if behind is not None:
            msg += f", when job {behind} is planned to end"
    p.wait(job, Reason.RESOURCES, msg, shown, resources=(c, job.gpus))


# ------------------------------------------------------------------ backfill


def backfill(p: Pass, jobs: Sequence[PendingJob]) -> None:
    """The jobs after the top blocked job (``reserve_top`` ran): each passes the
    gate; without backfill it waits ``PRIORITY``; past ``backfill_max_tested``
    tries it waits ``NOT_TESTED``; else ``backfill_one`` judges it."""
    top = p.top
    assert top is not None
    cfg = p.cfg
    max_tested = cfg.backfill_max_tested
    not_tested = (
        f"not tested this pass: backfill stopped after"
        f" {max_tested} jobs (backfill_max_tested)"
    )
    later = p.later
    not_tested_reason = Reason.NOT_TESTED
    rest = len(jobs)  # where the untested tail starts
    for i, job in enumerate(jobs):
        if p.tested >= max_tested and cfg.backfill:
            rest = i
            break
        c = gate(p, job)
        if c is None:
            continue
        if not cfg.backfill:
            p.stop_reason = STOP_BACKFILL_OFF
            p.wait(
                job,
                Reason.PRIORITY,
                f"behind job {top.id} (priority {p.prio[top.id]:.0f}, this job"
                f" {p.prio[job.id]:.0f}), which waits for GPUs; backfill is off",
            )
            continue
        p.tested += 1
        backfill_one(p, job, c)
    # past the budget, no job starts: each passes the gate (whose reasons come
    # first) or waits untested, in order
    for job in jobs[rest:]:
        if gate(p, job) is not None:
            p.stop_reason = STOP_BACKFILL_MAX_TESTED
            later.append((job, not_tested_reason, not_tested, None, None))


def backfill_one(p: Pass, job: PendingJob, c: Constraint) -> None:
    """Start ``job`` ahead of the top blocked job if it fits now and either ends
    (by its plan) by the shadow time or avoids the reserved GPUs; else it waits
    ``RESOURCES`` (it does not fit) or ``RESERVED_FOR_HIGHER``."""
    pack_first = p.pack_first
    if pack_first and share(p, job, c, bf=True, avoid=True):
        return
    got = try_place(p, job, c, avoid_reserved=False)
    if got is None:
        if not pack_first and share(p, job, c, bf=True, avoid=True):
            return
        if p.las_left > 0 and las_extra(p, job, c):
            return
        p.wait(
            job,
            Reason.RESOURCES,
            # Not named: the holder changes with nearly every start, and naming
            # it rewrote most waiting rows on each pass (the queue and the job's
            # page show the jobs ahead).
            "; the first job ahead of it that waits for GPUs holds the reservation",
            resources=(c, job.gpus),
        )
        return
    reservation = p.reservation
    assert reservation is not None
    shadow = reservation.shadow
    if shadow is None and not reservation.victims:
        start(p, job, got, bf=True)  # nothing can be protected: no planned start
        return
    if shadow is not None and p.now + p.idx.planned_s(job) <= shadow:
        # planned by its prediction to end by the shadow time; a guest when its
        # limit runs past it on reserved GPUs, so an overrun cannot delay the
        # top blocked job
        guest = (
            p.idx.predictions
            and p.now + job.time_limit_s > shadow
            and not reservation.gpu_ids.isdisjoint(g for pl in got for g in pl.gpu_ids)
            and _guest(p, job, shadow)
        )
        start(p, job, got, bf=True, guest=guest)
        return
    anywhere = got
    got = try_place(p, job, c, avoid_reserved=True)
    if got is not None:
        start(p, job, got, bf=True)
        return
    if not pack_first and share(p, job, c, bf=True, avoid=True):
        return
    if p.las_left > 0 and las_extra(p, job, c):
        return
    if (
        shadow is not None
        and _guest(p, job, shadow)
        and (
            p.cfg.guest_backfill == "on"
            or p.now + job.planned_s <= shadow  # "predicted"
        )
    ):
        start(p, job, anywhere, bf=True, guest=True)
        return
    p.wait(job, Reason.RESERVED_FOR_HIGHER, _held_message(p, job, shadow))


def _guest(p: Pass, job: PendingJob, shadow: float) -> bool:
    """``job`` may start as a guest on the reserved GPUs (``guest_backfill`` not
    "off"): it checkpoints, is not interactive, the top blocked job may preempt
    guests, the shadow time is at least a minimum run away (no guest is started
    only to be stopped at once), and it was preempted fewer times in the last
    hour than the hourly bound (``preempt_max_per_hour``) allows, so the bound
    leaves room for it to yield (``preempt.yields``; the count only falls while
    it runs): a guest that could not be stopped would hold the reserved GPUs to
    its end."""
    cfg = p.cfg
    if cfg.guest_backfill == "off" or not job.checkpointable:
        return False
    if job.preemptions_last_hour >= cfg.preempt_max_per_hour:
        return False
    top = p.top
    if top is None or not _guests_yield(p, top):
        return False
    spec = p.state.classes.get(job.priority_class)
    if spec is not None and spec.interactive:
        return False
    return shadow - p.now >= cfg.preempt_min_run_s


def _held_message(p: Pass, job: PendingJob, shadow: float | None) -> str:
    top, reservation = p.top, p.reservation
    assert top is not None and reservation is not None
    if reservation.victims:
        return (
            f"{gpus_word(job.gpus)} are free now, but they are held for job"
            f" {top.id}, which is preempting job(s)"
            f" {', '.join(map(str, reservation.victims))}"
        )
    assert shadow is not None
    return (
        f"{gpus_word(job.gpus)} are free now, but it would delay job {top.id},"
        f" reserved to start at {when(shadow, p.now)}: it is planned to run"
        f" {duration(p.idx.planned_s(job))}, past that, and the only GPUs that fit"
        f" it are reserved"
    )


# ------------------------------------------------------------------ reasons


def render_waits(p: Pass) -> None:
    """Exactly one ``Wait`` per job not started, in scheduling order, with its
    breakdown; messages that show the free GPUs read the final ledger."""
    # ``Wait(...)`` inlined: this loop runs once per waiting job, up to 10,000
    append = p.decisions.append
    new = object.__new__
    refusals = p.refusals
    breakdowns = p.breakdowns
    messages, ledger = p.messages, p.ledger
    for position, (job, reason, message, est, res) in enumerate(p.later, 1):
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
