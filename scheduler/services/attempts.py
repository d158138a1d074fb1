"""An attempt's life as its agents report it: its start (the job goes RUNNING)
and its end (the job's next state, from ``lifecycle.classify_exit``), one rank at a
time for a job spanning nodes.
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction

from agents import protocol
from scheduler import hooks
from scheduler.lifecycle import Cause, ExitFacts, classify_exit
from scheduler.models import Attempt, Job, JobEvent, Node
from scheduler.services import checkpoints, late_reports
from scheduler.services.common import _event, _send_kill_on_commit, _ts
from scheduler.services.lifecycle import (
    announce,
    end_attempt,
    transition,
    unlaunched_attempts,
)

log = logging.getLogger(__name__)


# Each rank's start (of a job spanning nodes) and each re-sent launch is also a job
# event: the job's timeline for its owner. Nothing reads them back; the state is
# ``Attempt.rank_starts`` / ``launch_resends`` / ``launch_resent_at``.
def rank_started_message(attempt: Attempt, rank: int, node: str, pid: int) -> str:
    return f"attempt {attempt.number} rank {rank}: running on {node} (pid {pid})"


def launch_resent_message(attempt: Attempt, rank: int, node: str, detail: str) -> str:
    who = f"attempt {attempt.number}"
    if len(attempt.node_ids) > 1:
        who += f" rank {rank}"
    return f"{who}: launch re-sent to {node} ({detail})"


def _attempt_of_node(node_id: int, attempt_id: int, job_id: int) -> Attempt | None:
    """The attempt, locked, if this node runs it (rank 0 or another rank) for this
    job: a node cannot report for another node's jobs."""
    attempt = (
        Attempt.objects.select_for_update().filter(pk=attempt_id, job_id=job_id).first()
    )
    if attempt is None or node_id not in attempt.node_ids:
        log.warning(
            "node %d reported attempt %d of job %d, which %s; ignored",
            node_id,
            attempt_id,
            job_id,
            "does not exist" if attempt is None else "is not allocated to it",
        )
        return None
    return attempt


def mark_started(node_id: int, data: protocol.JobStartedData) -> bool:
    """The agent started the attempt (a rank of it, for a job spanning nodes).

    1. Lock the attempt (it must belong to this node and job, and be live); a rank
       already in ``rank_starts`` is a replay: nothing changes.
    2. Record the rank's start in ``rank_starts`` (what ``liveness.resend_launches``
       reads); the first rank's is also the attempt's ``started_at`` / ``pid``,
       charged from there, and moves the job STARTING -> RUNNING.
    3. A job event says so (the timeline; never read back).
    """
    with transaction.atomic():
        attempt = _attempt_of_node(node_id, data.attempt_id, data.job_id)
        if attempt is None:
            return False
        if attempt.ended_at is not None:
            # Ended by the portal (lost node) before this start came: recorded
            # for its charge, the job left where it is.
            return late_reports.corrects(attempt) and late_reports.late_start(
                attempt, node_id, data
            )
        if attempt.rank_started(node_id):
            return False  # a replay of this rank's start
        spans = len(attempt.node_ids) > 1
        rank = attempt.node_ids.index(node_id)
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        started = _ts(data.started_at)
        first = attempt.started_at is None
        attempt.rank_starts = {
            **attempt.rank_starts,
            str(node_id): {"started_at": data.started_at, "pid": data.pid},
        }
        if first:
            attempt.started_at = started
            attempt.pid = data.pid
        if data.interactive_port is not None:
            # an interactive job's server: where the proxy forwards
            attempt.interactive_host = data.interactive_host
            attempt.interactive_port = data.interactive_port
            attempt.interactive_command = data.interactive_command
        if first and data.run_as:
            attempt.run_as = data.run_as
        attempt.save(
            update_fields=[
                "rank_starts",
                "started_at",
                "pid",
                "interactive_host",
                "interactive_port",
                "interactive_command",
                "run_as",
            ]
        )
        name = Node.objects.values_list("name", flat=True).get(pk=node_id)
        message = (
            rank_started_message(attempt, rank, name, data.pid)
            if spans
            else f"running on {name} (pid {data.pid})"
        )
        if not first:
            _event(job, message, source=JobEvent.Source.AGENT, at=started)
            return True
        hooks.accounting().attempt_started(attempt)
        if job.status == Job.Status.STARTING:
            transition(
                job,
                Job.Status.RUNNING,
                Cause.AGENT_STARTED,
                message,
                source=JobEvent.Source.AGENT,
                at=started,
                notice=f"running on {name}",
                started_at=job.started_at or started,
            )
            return True
        # Not STARTING (moved on meanwhile): its start is recorded, its state kept.
        if job.started_at is None:
            job.started_at = started
            job.save(update_fields=["started_at"])
        _event(
            job,
            message,
            source=JobEvent.Source.AGENT,
            from_status=job.status,
            to_status=job.status,
            at=started,
        )
        announce(job, "running")
    return True


def finish_attempt(node_id: int, data: protocol.JobExitedData) -> bool:
    """The agent reports an attempt's end. Idempotent: a duplicate is ignored.

    0. An attempt the portal already ended without the agent (its node was
       lost) gets its end and charge corrected, nothing else
       (``late_reports.late_exit``).
    1. Lock the attempt (it must belong to this node and job) and the job. A
       rank of a job spanning nodes is recorded; the attempt ends with its last
       rank (``_rank_exited``).
    2. Classify the exit (``lifecycle.classify_exit``); an attempt stopped to be
       requeued records the work it lost (``checkpoints.record_lost_work``).
       End the attempt: release its GPU slots, charge its GPU time from the
       agent's times, its lost work apart (``lifecycle.end_attempt``).
    3. Move the job as the verdict says (a preempted job passes
       through PREEMPTED back to PENDING, its age kept); the transition asks for a
       pass for the freed GPUs and tells browsers and the owner after commit.
    """
    with transaction.atomic():
        attempt = _attempt_of_node(node_id, data.attempt_id, data.job_id)
        if attempt is None:
            return False
        if attempt.ended_at is not None:
            # Ended by the portal (lost node, given-up launch): the agent's exit
            # corrects its end and charge; the job was requeued or failed once.
            return late_reports.corrects(attempt) and late_reports.late_exit(
                attempt, node_id, data
            )
        job = Job.objects.select_for_update().get(pk=attempt.job_id)
        if len(attempt.node_ids) > 1:
            if str(node_id) in attempt.rank_exits:
                return False  # a replayed rank exit
            whole = _rank_exited(attempt, job, node_id, data)
            if whole is None:
                return True  # other ranks still run
            data = whole
        ended = _ts(data.ended_at)
        if attempt.started_at is not None and ended < attempt.started_at:
            ended = attempt.started_at
        if job.status not in Job.ON_NODE:
            end_attempt(attempt, ended, data.reason, data.exit_code)
            # The job already moved on (e.g. requeued when its node was lost).
            _event(
                job,
                f"late exit of attempt {attempt.number} ignored ({data.reason})",
                source=JobEvent.Source.AGENT,
            )
            return True
        verdict = classify_exit(_exit_facts(attempt, job, node_id, data))
        if verdict.to in (Job.Status.PREEMPTED, Job.Status.PENDING):
            # Before the end is charged: the charge keeps the lost part apart.
            checkpoints.record_lost_work(attempt, job, ended)
        end_attempt(attempt, ended, data.reason, data.exit_code)
        if verdict.to == Job.Status.PREEMPTED:
            transition(
                job,
                verdict.to,
                verdict.cause,
                verdict.message,
                source=JobEvent.Source.AGENT,
                at=ended,
            )
            transition(
                job,
                Job.Status.PENDING,
                Cause.PREEMPTED,
                "requeued after preemption (its age is kept)",
                source=JobEvent.Source.AGENT,
                at=ended,
                preemptions=job.preemptions + 1,
                last_preempted_at=ended,
            )
            hooks.notifier().job_preempted(job, attempt, verdict.message)
        else:
            transition(
                job,
                verdict.to,
                verdict.cause,
                verdict.message,
                source=JobEvent.Source.AGENT,
                at=ended,
                exit_code=data.exit_code,
            )
    return True


def _exit_facts(
    attempt: Attempt, job: Job, node_id: int, data: protocol.JobExitedData
) -> ExitFacts:
    """What ``classify_exit`` decides on: the (combined) exit, why the server
    stopped the attempt, the job's cancel and requeue wishes, the names of the
    attempt's node and of the node that reported (for a rendezvous port busy:
    the node that found it busy), and, for an attempt that never ran, how many
    of the job's attempts did not."""
    names = dict(Node.objects.filter(pk__in=attempt.node_ids).values_list("pk", "name"))
    busy = [
        int(key)
        for key, rank_exit in attempt.rank_exits.items()
        if rank_exit.get("reason") == "port_busy"
    ]
    reporting = busy[0] if busy else node_id
    return ExitFacts(
        reason=data.reason,
        exit_code=data.exit_code,
        kill_reason=attempt.kill_reason,
        cancel_requested=job.cancel_requested_at is not None,
        requeue_on_node_loss=job.requeue_on_node_loss,
        time_limit_s=job.time_limit_s,
        message=data.message,
        node=names.get(attempt.node_id, "?"),
        reporting_node=names.get(reporting, "?"),
        # This attempt included: it is not ended yet (the verdict decides what
        # its end charges), so its own outcome is not among those counted.
        unlaunched=unlaunched_attempts(job) + 1 if data.reason == "port_busy" else 0,
        relaunch_max=settings.GPULAB_RELAUNCH_MAX,
    )


def _rank_exited(
    attempt: Attempt, job: Job, node_id: int, data: protocol.JobExitedData
) -> protocol.JobExitedData | None:
    """Record one rank's exit of a job spanning nodes (attempt and job locked).

    While other ranks run, return None; if this rank failed, ask the others to stop
    (``peer_failed``): a job with a dead rank would hang in its collectives. Once
    every rank has exited, return the attempt's exit: the first failure's, else a
    clean exit at the last rank's end. A replayed rank exit changes nothing.
    """
    key = str(node_id)
    attempt.rank_exits = {**attempt.rank_exits, key: data.model_dump(mode="json")}
    attempt.save(update_fields=["rank_exits"])
    failed = data.reason != "exited" or data.exit_code != 0
    rank = attempt.node_ids.index(node_id)
    if len(attempt.rank_exits) < len(attempt.node_ids):
        if failed and not attempt.kill_reason and job.cancel_requested_at is None:
            attempt.kill_reason = "peer_failed"
            attempt.save(update_fields=["kill_reason"])
            if data.reason == "port_busy":
                name = Node.objects.values_list("name", flat=True).get(pk=node_id)
                why = f"rank {rank} not started: {data.message} on node {name}"
            else:
                why = f"rank {rank} stopped ({data.reason}, exit code {data.exit_code})"
            _event(
                job,
                f"{why}; stopping the other ranks",
                source=JobEvent.Source.AGENT,
            )
            _send_kill_on_commit(attempt, "peer_failed", job.kill_grace_s)
        return None
    exits = [
        protocol.JobExitedData.model_validate(v) for v in attempt.rank_exits.values()
    ]
    last = max(e.ended_at for e in exits)
    busy = [e for e in exits if e.reason == "port_busy"]
    if busy:  # the attempt never ran: it is relaunched, whatever the others did
        return busy[0].model_copy(update={"ended_at": last})
    failures = sorted(
        (e for e in exits if e.reason != "exited" or e.exit_code != 0),
        key=lambda e: e.ended_at,
    )
    if failures:
        return failures[0].model_copy(update={"ended_at": last})
    return data.model_copy(
        update={"exit_code": 0, "reason": "exited", "ended_at": last}
    )
