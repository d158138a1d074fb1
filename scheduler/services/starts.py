"""Starting jobs: the ``Start`` decisions of a pass applied in a fixed number of
queries, and the ``job.launch`` frames (with torchrun's rank variables) they send.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from django.db import IntegrityError, transaction
from django.utils import timezone

from agents import protocol
from scheduler import events
from scheduler.lifecycle import Cause
from scheduler.models import Allocation, Attempt, Gpu, Job, JobEvent, Node, Profile
from scheduler.services.checkpoints import restart_count
from scheduler.services.lifecycle import END_REASON_MAX, start_many, transition

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence, Set

    from scheduler import policy

log = logging.getLogger(__name__)


def start_jobs(starts: Sequence[policy.Start], *, share_slots: bool = False) -> int:
    """Apply a pass's starts, each on its placements (one per node, rank 0 first),
    all or none; return how many started (the others are skipped).

    1. All at once (``_start_batch``), in one savepoint and a fixed number of
       queries whatever their number: lock the jobs, then their GPUs, both in id
       order, check each start, then bulk-create attempts, allocations and events.
    2. If that fails (a GPU slot taken by a concurrent pass that did not hold the
       scheduling lock: the unique constraint on live allocations; or a job whose
       launch frame is invalid), the savepoint is rolled back and each start runs
       alone in its own savepoint: a lost race skips that start, an unlaunchable
       job fails with the reason, the others start.
    """
    if not starts:
        return 0
    try:
        return _start_batch(starts, share_slots=share_slots)
    except (IntegrityError, _Unlaunchable) as exc:
        log.warning("batched start failed (%s); starting one by one", exc)
    started = 0
    for decision in starts:
        try:
            started += _start_batch([decision], share_slots=share_slots)
        except IntegrityError as exc:
            # Another pass took one of these slots first: the constraint held.
            log.warning("start of job %s skipped: %s", decision.job_id, exc)
        except _Unlaunchable as exc:
            # Its savepoint is rolled back (no attempt, no allocation): fail the job.
            _fail_unlaunchable(exc.job_id, exc.problem)
    return started


def _start_batch(starts: Sequence[policy.Start], *, share_slots: bool) -> int:
    """Start these jobs in one savepoint; return how many started.

    1. Lock every job (must be PENDING), then every GPU of every placement, each in
       id order: all jobs before any GPU, so passes doing the same never wait on
       each other in a cycle.
    2. Check each start in the policy's order (``_placed_gpus``): anything changed
       since the state was read (job no longer pending, a GPU taken, gone or given
       to an earlier start of this batch, a node down, draining or in maintenance): skip it.
    3. Create the attempts (``node`` = rank 0; ``ranks`` = every node, for a job
       spanning nodes) and one allocation per GPU slot in two bulk inserts; the jobs
       go STARTING (``lifecycle.start_many``: one UPDATE, one insert of events).
    4. After commit, send each node its ``job.launch`` (with its rank variables).
    Raises ``IntegrityError`` or ``_Unlaunchable`` with the savepoint rolled back.
    """
    with transaction.atomic():
        jobs = {
            job.pk: job
            for job in Job.objects.select_for_update()
            .filter(pk__in={d.job_id for d in starts}, status=Job.Status.PENDING)
            .order_by("pk")
        }
        wanted = {g for d in starts for p in d.placements for g in p.gpu_ids}
        gpus = {
            gpu.pk: gpu
            for gpu in Gpu.objects.select_for_update()
            .filter(pk__in=wanted)
            .order_by("pk")
        }
        # live slots of each wanted GPU: slot -> (attempt, its job)
        live: dict[int, dict[int, int]] = {}
        for gpu_id, slot, job_id in Allocation.objects.filter(
            gpu_id__in=list(gpus), released_at__isnull=True
        ).values_list("gpu_id", "slot", "attempt__job_id"):
            live.setdefault(gpu_id, {})[slot] = job_id
        busy = set(live)
        nodes = Node.objects.in_bulk(
            list({p.node_id for d in starts for p in d.placements})
        )
        planned: list[tuple[Job, list[int], list[Gpu]]] = []
        slots_of: dict[int, list[tuple[Gpu, int]]] = {}  # job -> (GPU, slot) taken
        admissions: dict[int, dict[str, Any]] = {}
        guests = {d.job_id for d in starts if d.guest}
        for decision in starts:
            job = jobs.pop(decision.job_id, None)  # a job starts once
            if job is None:
                continue
            if decision.admission is not None:
                # joins a GPU that runs jobs: the admitted partners must still be
                # the GPU's only jobs, and a slot free
                taken = _joined_slot(decision, gpus, nodes, live)
                if taken is None:
                    continue
                gpu, slot = taken
                live.setdefault(gpu.pk, {})[slot] = job.pk
                slots_of[job.pk] = [taken]
                admissions[job.pk] = admission_record(decision.admission)
                planned.append((job, [gpu.node_id], [gpu]))
                continue
            held = _placed_gpus(decision, gpus, nodes, busy)
            if held is None:
                continue
            busy.update(g.pk for g in held)
            # a shareable single-GPU job takes one slot, so a partner may join it;
            # any other job takes every slot of its GPUs
            alone = share_slots and job.shareable and len(held) == 1
            slots_of[job.pk] = [
                (g, slot)
                for g in held
                for slot in (range(1) if alone else range(g.slots))
            ]
            for g, slot in slots_of[job.pk]:
                live.setdefault(g.pk, {})[slot] = job.pk
            planned.append((job, [p.node_id for p in decision.placements], held))
        if not planned:
            return 0
        accounts = unix_accounts_of({job.owner_id for job, _, _ in planned})
        now = timezone.now()
        attempts = Attempt.objects.bulk_create(
            [
                Attempt(
                    job=job,
                    number=job.attempts + 1,
                    node=nodes[node_ids[0]],
                    created_at=now,
                    ranks=node_ids if len(node_ids) > 1 else [],
                    admission=admissions.get(job.pk),
                    guest=job.pk in guests,
                )
                for job, node_ids, _ in planned
            ]
        )
        Allocation.objects.bulk_create(
            [
                Allocation(attempt=attempt, gpu=g, slot=slot, allocated_at=now)
                for attempt, (job, _, _) in zip(attempts, planned, strict=True)
                for g, slot in slots_of[job.pk]
            ]
        )
        if admissions:
            # the joiners share from their start; their partners from now on
            Attempt.objects.filter(
                job_id__in={p for a in admissions.values() for p in a["partners"]},
                ended_at__isnull=True,
                shared_at__isnull=True,
            ).update(shared_at=now)
            Attempt.objects.filter(
                pk__in=[a.pk for a in attempts if a.job_id in admissions]
            ).update(shared_at=now)
        started: list[tuple[Job, str, str]] = []
        sends: list[tuple[int, dict[str, Any]]] = []
        for attempt, (job, node_ids, held) in zip(attempts, planned, strict=True):
            by_node = {n: [g for g in held if g.node_id == n] for n in node_ids}
            try:
                sends += [
                    (
                        n,
                        launch_frame(
                            job, attempt, by_node[n], nodes, accounts=accounts
                        ),
                    )
                    for n in node_ids
                ]
            except ValueError as exc:  # pydantic ValidationError is a ValueError
                raise _Unlaunchable(job.pk, str(exc)) from exc
            where = ", ".join(
                f"{nodes[g.node_id].name}:{g.index}"
                for n in node_ids
                for g in by_node[n]
            )
            if attempt.admission is not None:
                partners = ", ".join(map(str, attempt.admission["partners"]))
                where += (
                    f", shared with job(s) {partners}: {attempt.admission['message']}"
                )
            names = ", ".join(nodes[n].name for n in node_ids)
            started.append(
                (
                    job,
                    f"attempt {attempt.number} allocated {where}",
                    f"starting on {names}",
                )
            )
        start_many(started, at=now)
        # Registered last: a savepoint rolled back above drops nothing half-sent.
        for node_id, launch in sends:
            transaction.on_commit(partial(events.send_to_agent, node_id, launch))
    return len(planned)


def admission_record(adm: policy.colocate.Admission) -> dict[str, Any]:
    """The admission as stored on the attempt (JSON; slowdowns keyed by job id)."""
    return {
        "rule": adm.rule,
        "message": adm.message,
        "slowdowns": {str(k): round(v, 4) for k, v in adm.slowdowns.items()},
        "gain": None if adm.gain is None else round(adm.gain, 4),
        "confidence": None if adm.confidence is None else round(adm.confidence, 4),
        "trial": adm.trial,
        "partners": list(adm.partners),
        "workloads": list(adm.workloads),
    }


def _joined_slot(
    decision: policy.Start,
    gpus: Mapping[int, Gpu],
    nodes: Mapping[int, Node],
    live: Mapping[int, Mapping[int, int]],
) -> tuple[Gpu, int] | None:
    """The GPU and free slot a shared start takes, if the GPU still runs exactly
    the partners it was admitted with (each on one slot) and its node takes jobs
    (UP, not draining, not in maintenance). Else None: the start is skipped (the next pass decides again)."""
    assert decision.admission is not None
    (gpu_id,) = decision.gpu_ids
    gpu = gpus.get(gpu_id)
    if gpu is None or not gpu.schedulable:
        return None
    node = nodes.get(gpu.node_id)
    if node is None or not node.takes_jobs:
        return None
    slots = live.get(gpu_id, {})
    if sorted(slots.values()) != sorted(decision.admission.partners):
        return None
    free = [s for s in range(gpu.slots) if s not in slots]
    return (gpu, free[0]) if free else None


def _placed_gpus(
    decision: policy.Start,
    gpus: Mapping[int, Gpu],
    nodes: Mapping[int, Node],
    busy: Set[int],
) -> list[Gpu] | None:
    """The start's GPUs (locked, id order) if it can go ahead: each exists on one
    of its placements' nodes, is schedulable and has no live allocation; each node
    takes jobs (UP, not draining, not in maintenance). Else None: the start is
    skipped."""
    node_ids = {p.node_id for p in decision.placements}
    wanted = sorted({g for p in decision.placements for g in p.gpu_ids})
    held = [gpus[g] for g in wanted if g in gpus]
    if len(held) != len(wanted) or any(
        g.node_id not in node_ids or not g.schedulable or g.pk in busy for g in held
    ):
        return None
    if any(n not in nodes or not nodes[n].takes_jobs for n in node_ids):
        return None
    return held


class _Unlaunchable(Exception):
    def __init__(self, job_id: int, problem: str) -> None:
        super().__init__(f"job {job_id}: {problem}")
        self.job_id = job_id
        self.problem = problem


def _fail_unlaunchable(job_id: int, problem: str) -> None:
    """A job that no agent could be told to run fails with the reason, in its own
    savepoint, so one bad row never stops the pass for everyone else."""
    log.error("job %s cannot be launched: %s", job_id, problem)
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.status != Job.Status.PENDING:
            return
        message = f"cannot be launched: {problem}"[:END_REASON_MAX]
        transition(
            job,
            Job.Status.FAILED,
            Cause.UNLAUNCHABLE,
            message,
            source=JobEvent.Source.SCHEDULER,
        )


class UnixAccount(NamedTuple):
    """Whom a user's jobs run as: a name (empty: the node's default account, if
    it allows one, else it refuses the job) and, when known (from the lab's
    directory), the numbers the agent switches to without asking the node."""

    name: str
    uid: int | None = None
    gid: int | None = None
    gids: tuple[int, ...] = ()


NO_ACCOUNT = UnixAccount("")


def unix_accounts_of(user_ids: Iterable[int]) -> dict[int, UnixAccount]:
    """The Unix account of each user that has a profile (one query)."""
    rows = Profile.objects.filter(user_id__in=set(user_ids)).values_list(
        "user_id", "unix_account", "unix_uid", "unix_gid", "unix_gids"
    )
    return {
        user_id: UnixAccount(name, uid, gid, tuple(gids or ()))
        for user_id, name, uid, gid, gids in rows
    }


def unix_account_of(user_id: int) -> str | None:
    """The Unix account name a user's jobs run as (their profile), or None."""
    return unix_accounts_of([user_id]).get(user_id, NO_ACCOUNT).name or None


# Port of the rendezvous of a multi-node job on its rank-0 node: torchrun's default
# plus a per-attempt offset, so two jobs on one node do not collide.
MASTER_PORT_BASE = 29500


def rank_env(
    attempt: Attempt, node_id: int, gpus_here: int, nodes: Mapping[int, Node]
) -> dict[str, str]:
    """The variables ``torchrun`` (and ``torch.distributed``'s env:// init) expect on
    one node of a job spanning nodes; empty for a single-node job."""
    ranks = attempt.node_ids
    if len(ranks) < 2:
        return {}
    master = nodes[ranks[0]]
    values = {
        "NNODES": str(len(ranks)),
        "NODE_RANK": str(ranks.index(node_id)),
        "MASTER_ADDR": master.hostname or master.name,
        "MASTER_PORT": str(MASTER_PORT_BASE + attempt.pk % 1000),
        "NPROC_PER_NODE": str(gpus_here),
    }
    env = {f"GPULAB_{k}": v for k, v in values.items()}
    env.update({k: v for k, v in values.items() if k.startswith("MASTER_")})
    env.update({f"PET_{k}": v for k, v in values.items()})  # torchrun's own names
    return env


def launch_frame(
    job: Job,
    attempt: Attempt,
    gpus: list[Gpu],
    nodes: Mapping[int, Node] | None = None,
    *,
    accounts: Mapping[int, UnixAccount] | None = None,
) -> dict[str, Any]:
    """The ``job.launch`` for one node of the attempt (the node of ``gpus``), with
    its owner's Unix account: name, and uid, gid and supplementary gids when
    known. ``accounts`` (user id -> account), when given, saves a query per job."""
    if accounts is None:
        accounts = unix_accounts_of([job.owner_id])
    account = accounts.get(job.owner_id, NO_ACCOUNT)
    numbered = account.uid is not None and account.gid is not None
    node_id = gpus[0].node_id if gpus else attempt.node_id
    if nodes is None and len(attempt.node_ids) > 1:
        nodes = Node.objects.in_bulk(attempt.node_ids)
    env = {str(k): str(v) for k, v in job.env.items()}
    env.update(rank_env(attempt, node_id, len(gpus), nodes or {}))
    # How many earlier starts ended in a requeue: a checkpointable job resumes
    # from its checkpoint when it is above 0.
    env["GPULAB_RESTART_COUNT"] = str(restart_count(attempt))
    if job.array_id is not None:
        # a task of a job array learns which one it is
        env["GPULAB_ARRAY_ID"] = str(job.array_id)
        env["GPULAB_ARRAY_INDEX"] = str(job.array_index)
    return events.frame(
        protocol.JobLaunch,
        protocol.JobLaunchData(
            attempt_id=attempt.pk,
            attempt=attempt.number,
            job_id=job.pk,
            name=job.name,
            command=job.command,
            workdir=job.workdir,
            env=env,
            gpu_uuids=[g.uuid for g in sorted(gpus, key=lambda g: g.index)],
            grace_s=job.kill_grace_s,
            time_limit_s=job.time_limit_s,
            run_as=account.name or None,
            run_as_uid=account.uid if numbered else None,
            run_as_gid=account.gid if numbered else None,
            run_as_gids=list(account.gids) if numbered else [],
            interactive=cast("protocol.InteractiveKind", job.interactive),
            interactive_token=job.interactive_token,
            interactive_base_url=interactive_base_url(job.pk)
            if job.interactive
            else "",
        ),
    )


def interactive_base_url(job_id: int) -> str:
    """Where the portal's proxy serves an interactive job: its server's base URL."""
    return f"/interactive/{job_id}/"


def rank_launch(attempt: Attempt, node_id: int) -> dict[str, Any]:
    """The ``job.launch`` of the attempt's rank on ``node_id``: its GPUs there (and,
    for a job spanning nodes, that rank's variables)."""
    gpus = [
        a.gpu
        for a in attempt.allocations.select_related("gpu").filter(gpu__node_id=node_id)
    ]
    unique = list({g.pk: g for g in gpus}.values())
    return launch_frame(attempt.job, attempt, unique)
