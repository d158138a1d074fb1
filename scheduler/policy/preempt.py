"""The reservation stage (gpulab only): a preemption plan for the top blocked job.

Three kinds of victims, tried in this order: by class (below), guests
(``guests``: checkpointable jobs started on GPUs a reservation held, which yield
them; docs/policy.md "Guests on reserved GPUs"), then by least attained service
(``las_candidates``: checkpointable jobs, the most attained first; docs/policy.md
"Preemption by attained service"). All use the same minimal-set search (``plan``).

Class preemption is only for a job of a non-preemptible class; victims are running jobs marked
``preemptible`` that were preempted fewer than ``preempt_max_per_hour`` times in the
last hour (so a best-effort job is never stopped for another best-effort job, nor
stopped over and over). Kueue's ``minimalPreemptions``: order the candidates (groups
over their fair share first, then lower priority, then the youngest), free them one
by one on a scratch ledger until the job fits, then add them back in reverse (all but
the last removed) while it still fits. What is left is the minimal set this order
gives. A GPU frees only when every running job on it is a victim, and only GPUs of
schedulable nodes count. At most one plan per pass (``stages.reserve_top`` asks once).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.policy.ledger import Ledger
from scheduler.policy.place import _fitting, is_gang, place
from scheduler.policy.priority import class_factor
from scheduler.policy.remaining import expected_end
from scheduler.policy.state import is_interactive
from scheduler.policy.wait_bound import overdue_running

if TYPE_CHECKING:
    from scheduler.policy.fairshare import FairShare
    from scheduler.policy.index import Constraint, PassIndex
    from scheduler.policy.stages import Pass
    from scheduler.policy.state import (
        GpuView,
        PendingJob,
        Placement,
        PolicyConfig,
        RunningJob,
    )


@dataclass(frozen=True)
class Plan:
    victims: list[RunningJob]  # to stop now, in removal order (may be empty)
    placements: tuple[Placement, ...]  # where the job goes once they are gone
    waiting_on: tuple[int, ...] = ()  # jobs already being stopped that it uses


def candidates(idx: PassIndex, fairshare: FairShare) -> list[RunningJob]:
    state = idx.state
    cfg = state.config

    def key(r: RunningJob) -> tuple[int, float, float, int]:
        prio = cfg.weight_class * class_factor(
            r.priority_class, 0.0, state.classes
        ) + cfg.weight_fairshare * fairshare.of(r.group, r.user)
        return (0 if fairshare.over_share(r.group) else 1, prio, -r.started_at, r.id)

    return sorted(
        (
            r
            for r in state.running
            if r.preemptible
            and not r.stopping
            and r.preemptions_last_hour < cfg.preempt_max_per_hour
            and not is_interactive(state, r)
        ),
        key=key,
    )


def top_queue(job: PendingJob, cfg: PolicyConfig) -> bool:
    """``job`` would still be in the top LAS queue at the end of its protected
    minimum run: attained + gpus x ``preempt_min_run_s`` < ``las_threshold_gpu_s``."""
    return (
        job.attained_gpu_s + job.gpus * cfg.preempt_min_run_s < cfg.las_threshold_gpu_s
    )


def las_candidates(idx: PassIndex, job: PendingJob) -> list[RunningJob]:
    """The running jobs ``job`` may preempt by attained service, most attained
    first (then the latest started, then the highest id).

    Two queues, as Tiresias' discretised LAS: a job is in the top queue while
    its attained service (GPUs x seconds run, every attempt) is under
    ``las_threshold_gpu_s``. ``job`` may preempt only if it would still be in the
    top queue at the end of its own protected minimum run (``top_queue``); a
    victim ``v`` is in the lower queue (attained >= the threshold), checkpointable,
    not already being stopped, preempted fewer than ``preempt_max_per_hour`` times
    in the last hour, has run at least ``preempt_min_run_s`` in its current
    attempt, is of a class whose weight is not above ``job``'s, and has been in
    the system at most ``las_max_slowdown`` times its service time (attained /
    GPUs; ``RunningJob.las_slowdown``): the wait bound. With ``las_victims``
    "checkpoint" the least work lost first (``lost_gpu_s``: since the last
    checkpoint), then the most attained; with "remaining" the most time left
    first (``remaining_s``: a job about to end frees its GPUs soon anyway, so
    stopping it gains ``job`` little and costs its owner the restart), then the
    most attained. With ``las_shorter`` a victim must have more
    time left (``remaining_s``) than ``job`` is planned to run (``planned_s``):
    stopping a job for a longer one delays it more than it saves ``job``, the
    exchange argument of shortest-remaining-first. A victim
    waits in the lower queue, behind ``job`` (``las_order``), so it cannot take
    the GPUs straight back: no job is started only to be preempted at once.

    An interactive ``job`` (``ClassSpec.interactive``) needs no rank: any
    checkpointable batch job within the same bounds (hourly, minimum run, not
    being stopped) is a victim, the most attained first. An interactive job is
    never a victim."""
    state = idx.state
    cfg = state.config
    interactive = is_interactive(state, job)
    if not interactive and not top_queue(job, cfg):
        return []
    now = state.now
    classes = state.classes
    min_run = cfg.preempt_min_run_s
    bar = cfg.las_threshold_gpu_s
    own = classes.get(job.priority_class)
    weight = own.weight if own is not None else 0.0
    by_loss = cfg.las_victims == "checkpoint"
    by_left = cfg.las_victims == "remaining"
    # ``las_shorter``: only victims with more time left than ``job`` needs
    shorter = cfg.las_shorter and not interactive
    out: list[tuple[float, float, float, int, RunningJob]] = []
    for r in state.running:
        if (
            not r.checkpointable
            or r.stopping
            or r.preemptions_last_hour >= cfg.preempt_max_per_hour
            or now - r.started_at < min_run
        ):
            continue
        spec = classes.get(r.priority_class)
        if spec is not None and spec.interactive:
            continue
        left = remaining_s(idx, r) if shorter or by_left else 0.0
        if shorter and left <= job.planned_s:
            continue  # it ends before ``job`` would: stopping it gains nothing
        if r.las_slowdown(now) > cfg.las_max_slowdown:
            continue  # the wait bound: it has waited as long as it may
        if overdue_running(r, now, cfg.max_wait_s, cfg.preempted_max_wait_s):
            continue  # it waited over a bound (``wait_bound``)
        attained = r.attained_gpu_s(now)
        if interactive or (
            attained >= bar and not (spec is not None and spec.weight > weight)
        ):
            out.append(
                (
                    lost_gpu_s(r, now) if by_loss else -left,
                    -attained,
                    -r.started_at,
                    -r.id,
                    r,
                )
            )
    out.sort(key=lambda t: t[:4])
    return [t[4] for t in out]


def guests(idx: PassIndex) -> list[RunningJob]:
    """The guests the top blocked job may preempt (``PolicyConfig.guest_backfill``):
    running jobs started as guests on GPUs a reservation held (``yields``) that
    have run at least ``preempt_min_run_s`` (so no guest is started only to be
    stopped at once); the latest started first (the least work done). A guest
    consented to yield by starting as one, so the LAS queues and wait bound do
    not apply; an interactive job is never a guest."""
    state = idx.state
    now = state.now
    min_run = state.config.preempt_min_run_s
    out = [
        r
        for r in state.running
        if yields(r, state.config) and now - r.started_at >= min_run
    ]
    out.sort(key=lambda r: (-r.started_at, -r.id))
    return out


def yields(r: RunningJob, cfg: PolicyConfig) -> bool:
    """``r`` is a guest that may still be preempted: not already being stopped,
    and preempted fewer than ``preempt_max_per_hour`` times in the last hour (a
    guest over the hourly bound runs on, and the top blocked job plans around
    its end like any other job's)."""
    return (
        r.guest
        and not r.stopping
        and r.preemptions_last_hour < cfg.preempt_max_per_hour
    )


def guest_end(idx: PassIndex) -> Callable[[RunningJob], float]:
    """A running job's planned end for the reservation: a guest's GPUs free when
    it may first be preempted (its minimum run), if that is before its planned
    end; every other job's at ``PassIndex.planned_end``."""
    planned_end = idx.planned_end
    cfg = idx.state.config
    min_run = cfg.preempt_min_run_s
    now = idx.state.now

    def end_of(r: RunningJob) -> float:
        end = planned_end(r)
        if yields(r, cfg):
            return min(end, max(now, r.started_at + min_run))
        return end

    return end_of


def lost_gpu_s(r: RunningJob, now: float) -> float:
    """The work ``r`` would lose if stopped now: GPUs x seconds since its last
    checkpoint of this attempt (``RunningJob.checkpoint_at``), else since its
    start."""
    since = (
        r.started_at if r.checkpoint_at is None else max(r.checkpoint_at, r.started_at)
    )
    return len(r.gpu_ids) * max(now - since, 0.0)


def remaining_s(idx: PassIndex, r: RunningJob) -> float:
    """The time ``r`` is expected to run still: its expected end - now, the end
    from its reported progress where the policy reads progress, else from its
    prediction (``remaining.expected_end`` with predictions, even where backfill
    plans with limits: an estimate to rank victims by, not a promise)."""
    now = idx.state.now
    end = expected_end(
        r.started_at,
        r.planned_s,
        r.time_limit_s,
        now,
        r.progress if idx.progress else None,
        predictions=True,
    )
    return max(end - now, 0.0)


def las_order(p: Pass, base: list[PendingJob]) -> list[PendingJob]:
    """``base``, the scheduling order, with the LAS rule applied.

    The multifactor order (priority desc, the higher class, submitted, id), except
    that a waiting job ``v`` that was preempted (``preempted_at``), checkpoints
    and is in the lower queue (attained service at least ``las_threshold_gpu_s``)
    goes right after the last waiting job ``w`` that is in the top queue
    (``top_queue``), of a class weight at least its own, and was submitted by
    ``v``'s preemption: a job preempted by attained service never starts again
    ahead of the job it was stopped for. It yields only to jobs that were waiting
    when it was stopped, never to later arrivals, and only while its time since
    submission is at most ``las_max_slowdown`` times its service time (attained /
    GPUs). The rest keep their order."""
    state = p.state
    cfg = p.cfg
    bar = cfg.las_threshold_gpu_s
    now = state.now
    most = cfg.las_max_slowdown
    movers = [
        (i, j)
        for i, j in enumerate(base)
        if j.preempted_at is not None
        and j.checkpointable
        and j.attained_gpu_s >= bar
        and (now - j.submitted_at) * j.gpus <= most * j.attained_gpu_s
    ]
    if not movers:
        return base
    classes = state.classes

    def weight(j: PendingJob) -> float:
        spec = classes.get(j.priority_class)
        return spec.weight if spec is not None else 0.0

    # per class weight: the top-queue jobs of that weight or more by submit
    # time, with the running maximum of their positions
    tops = [
        (j.submitted_at, i, weight(j)) for i, j in enumerate(base) if top_queue(j, cfg)
    ]
    tops.sort()
    stamps = [t for t, _, _ in tops]
    prefix: dict[float, list[int]] = {}
    for lv in {weight(j) for _, j in movers}:
        best, run = -1, []
        for _, i, w in tops:
            if w >= lv and i > best:
                best = i
            run.append(best)
        prefix[lv] = run
    key = list(range(len(base)))
    sub = [0] * len(base)
    for i, v in movers:
        assert v.preempted_at is not None
        n = bisect_right(stamps, v.preempted_at)
        after = prefix[weight(v)][n - 1] if n else -1
        if after > i:
            key[i], sub[i] = after, 1
    keyed = sorted(zip(key, sub, range(len(base)), strict=True))
    return [base[k[2]] for k in keyed]


def plan(
    c: Constraint,
    k: int,
    ledger: Ledger,
    idx: PassIndex,
    fairshare: FairShare,
    *,
    spread: bool,
    topology: bool,
    cands: list[RunningJob] | None = None,
    held: frozenset[int] = frozenset(),
) -> Plan | None:
    """The victims (in removal order) and where the job then goes, or None.

    GPUs of jobs already being stopped (``RunningJob.stopping``, e.g. the victims
    of an earlier pass still in their grace period) count as free: when they
    suffice, the plan has no new victims and the job keeps waiting for them.
    ``held``: GPUs an earlier plan or reservation of this pass holds; the plan
    neither takes them when free nor frees them (a later plan of the pass,
    ``stages.las_extra``).

    A single-node job gets one remove-then-add-back plan per node holding
    candidates, and the plan with the fewest victims wins (then the one whose victims
    come earliest in the candidate order, then the node's name): the order alone
    could free four GPUs on one node when two on another suffice. A gang gets one
    plan over the whole cluster.
    """
    if cands is None:
        cands = candidates(idx, fairshare)
    stopping = [r for r in idx.state.running if r.stopping]
    if not cands and not stopping:
        return None
    freed_by = _freeing(idx, held)
    if held:
        ledger = ledger.copy()
        for node_id, gpus in list(ledger.free.items()):
            mine = [g.id for g in gpus if g.id in held]
            if mine:
                ledger.take(node_id, mine)
    # the GPUs of jobs being stopped are as good as free
    gone = {r.id for r in stopping}
    if stopping:
        ledger = ledger.copy()
        for r in stopping:
            for g in freed_by(gone, r):
                ledger.give(g.node_id, (g,))
        placements = place(ledger, idx, c, k, spread=spread, topology=topology)
        if placements is not None:
            return Plan([], placements, _waiting_on(stopping, placements))
    if is_gang(idx, c, k):
        got = _gang_plan(c, k, ledger, idx, cands, freed_by, gone, spread, topology)
    else:
        got = _node_plan(c, k, ledger, idx, cands, freed_by, gone, spread, topology)
    return None if got is None else Plan(*got, _waiting_on(stopping, got[1]))


FreedBy = Callable[[set[int], "RunningJob"], list["GpuView"]]


def _freeing(idx: PassIndex, held: frozenset[int] = frozenset()) -> FreedBy:
    """``freed_by(victims, r)``: the GPUs that free when ``r`` stops, given the
    other victims (a GPU frees when every job on it is a victim; only schedulable
    GPUs of schedulable nodes count, none of ``held``)."""
    on_gpu: dict[int, set[int]] = {}
    for r in idx.state.running:
        for gid in r.gpu_ids:
            on_gpu.setdefault(gid, set()).add(r.id)

    def freed_by(victims: set[int], r: RunningJob) -> list[GpuView]:
        out = []
        for gid in r.gpu_ids:
            gpu = idx.gpu_by_id.get(gid)
            if gpu is None or not gpu.schedulable or gpu.slots <= 0:
                continue
            if gpu.node_id not in idx.schedulable_nodes or gid in held:
                continue
            if on_gpu[gid] <= victims:
                out.append(gpu)
        return out

    return freed_by


def _node_plan(
    c: Constraint,
    k: int,
    ledger: Ledger,
    idx: PassIndex,
    cands: list[RunningJob],
    freed_by: FreedBy,
    gone: set[int],
    spread: bool,  # noqa: FBT001
    topology: bool,  # noqa: FBT001
) -> tuple[list[RunningJob], tuple[Placement, ...]] | None:
    """A single-node job: one remove-then-add-back plan per node holding
    candidates; the fewest victims win, then the earliest in candidate order, then
    the node's name."""
    view = idx.view(c)
    rank = {r.id: i for i, r in enumerate(cands)}
    by_node: dict[int, list[RunningJob]] = {}
    for r in cands:
        for node_id in {
            idx.gpu_by_id[g].node_id for g in r.gpu_ids if g in idx.gpu_by_id
        }:
            by_node.setdefault(node_id, []).append(r)
    best: (
        tuple[tuple[int, int, tuple[str, int]], int, list[RunningJob], list[GpuView]]
        | None
    ) = None
    for node_id, subset in by_node.items():
        if node_id not in idx.schedulable_nodes or view.node_capacity[node_id] < k:
            continue
        count = len(_fitting(ledger, idx, c, node_id, frozenset()))
        removed: list[RunningJob] = []
        victims: set[int] = set(gone)
        freed: dict[int, list[GpuView]] = {}
        for r in subset:
            removed.append(r)
            victims.add(r.id)
            freed[r.id] = [
                g
                for g in freed_by(victims, r)
                if g.node_id == node_id and g.id in view.matching
            ]
            count += len(freed[r.id])
            if count >= k:
                break
        if count < k:
            continue
        for r in reversed(removed[:-1]):
            if count - len(freed[r.id]) >= k:
                victims.discard(r.id)
                count -= len(freed[r.id])
        chosen = [r for r in removed if r.id in victims]
        key = (len(chosen), max(rank[r.id] for r in chosen), idx.node_key[node_id])
        if best is None or key < best[0]:
            gpus = [g for r in chosen for g in freed[r.id]]
            best = (key, node_id, chosen, gpus)
    if best is None:
        return None
    _, node_id, chosen, gpus = best
    mini = Ledger(
        {node_id: sorted([*ledger.free.get(node_id, []), *gpus], key=lambda g: g.index)}
    )
    placements = place(mini, idx, c, k, spread=spread, topology=topology)
    if placements is None:  # pragma: no cover - it fitted above
        return None
    return chosen, placements


def _waiting_on(
    stopping: list[RunningJob], placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    taken = {g for p in placements for g in p.gpu_ids}
    return tuple(r.id for r in stopping if taken.intersection(r.gpu_ids))


def _gang_plan(
    c: Constraint,
    k: int,
    ledger: Ledger,
    idx: PassIndex,
    cands: list[RunningJob],
    freed_by: FreedBy,
    gone: set[int],
    spread: bool,  # noqa: FBT001
    topology: bool,  # noqa: FBT001
) -> tuple[list[RunningJob], tuple[Placement, ...]] | None:
    view = idx.view(c)
    scratch = ledger.copy()
    total = sum(len(_fitting(scratch, idx, c, n, frozenset())) for n in scratch.free)
    removed: list[RunningJob] = []
    victims: set[int] = set(gone)
    freed: dict[int, list[GpuView]] = {}
    for r in cands:
        removed.append(r)
        victims.add(r.id)
        freed[r.id] = gpus = freed_by(victims, r)
        for g in gpus:
            scratch.give(g.node_id, (g,))
        total += sum(1 for g in gpus if g.id in view.matching)
        if total >= k:
            break
    if total < k:
        return None
    for r in reversed(removed[:-1]):
        still = total - sum(1 for g in freed[r.id] if g.id in view.matching)
        if still >= k:
            victims.discard(r.id)
            total = still
            for g in freed[r.id]:
                scratch.take(g.node_id, (g.id,))
    placements = place(scratch, idx, c, k, spread=spread, topology=topology)
    if placements is None:  # pragma: no cover - it fitted above
        return None
    return [r for r in removed if r.id in victims], placements
