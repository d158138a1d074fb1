"""The job lifecycle's rules: which state changes are allowed and for which
causes, and what an attempt's end makes of its job.

Pure (no query, no side effect): ``scheduler.services.lifecycle`` is the only code
that writes a job's state, and it checks every change against ``TRANSITIONS``
here; ``classify_exit`` decides a job's next state from the facts of its
attempt's end. A job is born PENDING (``services.submit_job``); every later
state is one row of the table::

    PENDING -> HELD -> PENDING                          (hold / release)
    PENDING | HELD -> CANCELLED                         (cancel of a waiting job)
    PENDING -> STARTING -> RUNNING                      (a pass starts it; the agent)
    PENDING -> FAILED                                   (no agent can be told to run it)
    STARTING | RUNNING -> COMPLETED | FAILED | CANCELLED | TIMEOUT   (its end)
    STARTING | RUNNING -> PREEMPTED -> PENDING          (preemption; age kept)
    STARTING | RUNNING -> PENDING                       (evicted, requeued, node or
                                                         process lost, not launched)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

from scheduler.models import Job

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

S = Job.Status


class Cause(StrEnum):
    """Why a job changes state: the reason code each transition is checked with."""

    HOLD = "hold"  # its owner or an admin held it
    RELEASE = "release"  # the hold was released
    CANCEL = "cancel"  # its owner, an admin or gpulab (idle) cancelled it
    START = "start"  # a pass allocated its GPUs
    UNLAUNCHABLE = "unlaunchable"  # no launch frame can be built for it
    AGENT_STARTED = "agent_started"  # its first rank's process started
    EXIT_OK = "exit_ok"  # its process exited 0
    EXIT_ERROR = "exit_error"  # its process exited non-zero
    LAUNCH_FAILED = "launch_failed"  # the agent could not start it
    KILLED = "killed"  # stopped by the server for a reason with no rule of its own
    PEER_FAILED = "peer_failed"  # another rank of it failed
    MEMORY_OVERRUN = "memory_overrun"  # over its declared memory on a shared GPU
    TIME_LIMIT = "time_limit"  # stopped at its time limit
    QUOTA = "quota"  # stopped: a hard quota of it is used up
    PREEMPTED = "preempted"  # stopped for a job of a higher class
    EVICTED = "evicted"  # sharing ended to keep a slowdown cap (colocate.evictions)
    REQUEUE = "requeue"  # an admin sent it back to the queue
    NODE_LOST = "node_lost"  # its node stopped reporting
    PROCESS_LOST = "process_lost"  # its process vanished without an exit code
    NOT_LAUNCHED = "not_launched"  # its launch never ran (port busy, launch lost)


@dataclass(frozen=True)
class Rule:
    """Jobs in any of ``sources`` may go to ``to`` for any of ``causes``.

    ``wakes_pass``: the change frees GPUs or changes the queue, so a scheduling
    pass is asked for after commit."""

    sources: tuple[S, ...]
    to: S
    causes: frozenset[Cause]
    wakes_pass: bool


def _rule(
    sources: Iterable[S], to: S, causes: Iterable[Cause], *, wakes_pass: bool = True
) -> Rule:
    return Rule(tuple(sources), to, frozenset(causes), wakes_pass)


ON_NODE = (S.STARTING, S.RUNNING)
C = Cause

RULES: tuple[Rule, ...] = (
    _rule([S.PENDING], S.HELD, [C.HOLD]),
    _rule([S.HELD], S.PENDING, [C.RELEASE]),
    _rule([S.PENDING, S.HELD], S.CANCELLED, [C.CANCEL]),
    # Started by the pass itself: asking for another pass would only repeat it.
    _rule([S.PENDING], S.STARTING, [C.START], wakes_pass=False),
    _rule([S.PENDING], S.FAILED, [C.UNLAUNCHABLE], wakes_pass=False),
    _rule([S.STARTING], S.RUNNING, [C.AGENT_STARTED], wakes_pass=False),
    _rule(ON_NODE, S.COMPLETED, [C.EXIT_OK]),
    _rule(
        ON_NODE,
        S.FAILED,
        [
            C.EXIT_ERROR,
            C.LAUNCH_FAILED,
            C.KILLED,
            C.PEER_FAILED,
            C.MEMORY_OVERRUN,
            C.NODE_LOST,
            C.PROCESS_LOST,
            C.NOT_LAUNCHED,
        ],
    ),
    _rule(ON_NODE, S.CANCELLED, [C.CANCEL, C.QUOTA]),
    _rule(ON_NODE, S.TIMEOUT, [C.TIME_LIMIT]),
    _rule(ON_NODE, S.PREEMPTED, [C.PREEMPTED]),
    _rule([S.PREEMPTED], S.PENDING, [C.PREEMPTED]),
    _rule(
        ON_NODE,
        S.PENDING,
        [C.EVICTED, C.REQUEUE, C.NODE_LOST, C.PROCESS_LOST, C.NOT_LAUNCHED],
    ),
)

# (from, to) -> the rule allowing it.
TRANSITIONS: Mapping[tuple[S, S], Rule] = {
    (source, rule.to): rule for rule in RULES for source in rule.sources
}

# States a job only passes through inside the transaction that leaves them: the
# change into one is recorded (its event) but not announced; the next one is.
PASSING: frozenset[S] = frozenset({S.PREEMPTED})


class ForbiddenTransition(Exception):
    """A state change the table does not allow; nothing was changed."""

    def __init__(self, job_id: int | None, source: str, to: str, cause: str) -> None:
        allowed = sorted(
            f"{to_} ({', '.join(sorted(r.causes))})"
            for (from_, to_), r in TRANSITIONS.items()
            if from_ == source
        )
        super().__init__(
            f"job #{job_id}: {source} -> {to} for cause {str(cause)!r} is not"
            " allowed;"
            f" from {source} a job may go to: {'; '.join(allowed) or 'nothing'}"
        )
        self.job_id = job_id
        self.source = source
        self.to = to
        self.cause = cause


def check(job_id: int | None, source: str, to: str, cause: Cause) -> Rule:
    """The rule allowing ``source -> to`` for ``cause``, or ``ForbiddenTransition``."""
    rule = TRANSITIONS.get((S(source), S(to))) if _valid(source, to) else None
    if rule is None or cause not in rule.causes:
        raise ForbiddenTransition(job_id, source, to, cause)
    return rule


def _valid(*states: str) -> bool:
    return all(s in S.values for s in states)


# ------------------------------------------------------------------ exits


@dataclass(frozen=True)
class ExitFacts:
    """What is known when an attempt ends.

    ``reason`` / ``exit_code`` / ``message``: the agent's report (an
    ``agents.protocol.ExitReason``; for a job spanning nodes, the attempt's
    combined exit); ``kill_reason``: why the server asked the agent to stop it
    ("" if it did not); ``cancel_requested``: a cancel was asked for the job;
    ``node``: its (rank 0) node's name; ``reporting_node``: the name of the node
    whose report decided (the one whose rendezvous port was busy);
    ``unlaunched``: its attempts, this one included, that ended without running
    (``Attempt.UNLAUNCHED``), against ``relaunch_max``."""

    reason: str
    exit_code: int | None
    kill_reason: str = ""
    cancel_requested: bool = False
    requeue_on_node_loss: bool = True
    time_limit_s: int = 0
    message: str = ""
    node: str = ""
    reporting_node: str = ""
    unlaunched: int = 0
    relaunch_max: int = 0


@dataclass(frozen=True)
class Verdict:
    """The job's next state, the cause it is checked with, and the event's
    message (also the job's end reason when it ends)."""

    to: S
    cause: Cause
    message: str


def classify_exit(f: ExitFacts) -> Verdict:
    """The job's next state after its attempt ended as ``f`` says; first match:

    1. a cancel was asked: CANCELLED, however it exited (a script that catches
       SIGTERM and exits 0 was still cancelled);
    2. the server stopped it: preempted -> PREEMPTED (then PENDING), evicted or
       requeued -> PENDING, quota -> CANCELLED, memory overrun -> FAILED;
    3. its rendezvous port was busy (nothing ran): relaunched (``relaunch``);
    4. its time limit (agent or server): TIMEOUT;
    5. a failed rank stopped the others: FAILED;
    6. its own exit: 0 -> COMPLETED, else FAILED; killed by the server for
       another reason -> FAILED; a failed launch -> FAILED;
    7. anything else (lost, never started, killed by the agent cut off from the
       portal): a node problem, not the user's: PENDING if the job requeues on
       node loss, else FAILED.
    """
    code, kill, why = f.exit_code, f.kill_reason, f.reason
    if f.cancel_requested:
        return Verdict(S.CANCELLED, C.CANCEL, "cancelled; process stopped")
    if kill == "preempted":
        return Verdict(
            S.PREEMPTED, C.PREEMPTED, f"preempted; process stopped (exit code {code})"
        )
    if kill == "evicted":
        return Verdict(
            S.PENDING,
            C.EVICTED,
            "sent back to the queue (its age is kept): the scheduler ended its"
            " sharing of a GPU to keep a slowdown cap, for the reason above"
            f" (exit code {code})",
        )
    if kill == "quota":
        return Verdict(
            S.CANCELLED,
            C.QUOTA,
            "stopped by the scheduler: a hard quota of it is used up"
            f" (GPULAB_QUOTA_OVERRUN=stop), exit code {code}",
        )
    if kill == "requeued":
        return Verdict(
            S.PENDING,
            C.REQUEUE,
            f"sent back to the queue by an admin (its age is kept; exit code {code})",
        )
    if kill == "memory_overrun":
        return Verdict(
            S.FAILED,
            C.MEMORY_OVERRUN,
            "stopped: it used more GPU memory than it declared on a shared GPU"
            f" (exit code {code})",
        )
    if why == "port_busy":
        return relaunch(
            f"{f.message} on node {f.reporting_node}", f.unlaunched, f.relaunch_max
        )
    if why == "timeout" or kill == "timeout":
        limit = timedelta(seconds=f.time_limit_s)
        return Verdict(S.TIMEOUT, C.TIME_LIMIT, f"stopped at its time limit ({limit})")
    if kill == "peer_failed" and why in ("exited", "killed"):
        return Verdict(
            S.FAILED,
            C.PEER_FAILED,
            f"a rank failed with exit code {code}; the others were stopped",
        )
    if why == "exited" and code == 0:
        return Verdict(S.COMPLETED, C.EXIT_OK, "completed (exit code 0)")
    if why == "exited":
        # The user's program failed: a user error, not a system one.
        return Verdict(S.FAILED, C.EXIT_ERROR, f"failed with exit code {code}")
    if why == "killed" and kill:
        return Verdict(S.FAILED, C.KILLED, f"stopped ({kill}), exit code {code}")
    if why == "launch_failed":
        return Verdict(
            S.FAILED,
            C.LAUNCH_FAILED,
            f"could not be started: {f.message or 'launch failed'}",
        )
    what = f.message or f"process {why}"
    if f.requeue_on_node_loss:
        return Verdict(S.PENDING, C.PROCESS_LOST, f"requeued: {what} on {f.node}")
    return Verdict(S.FAILED, C.PROCESS_LOST, f"failed: {what} on {f.node}")


def relaunch(what: str, unlaunched: int, limit: int) -> Verdict:
    """An attempt that never ran (``unlaunched`` of the job's attempts so, this
    one included): PENDING again, its age kept, while at most ``limit`` did;
    then FAILED."""
    if unlaunched <= limit:
        return Verdict(
            S.PENDING,
            C.NOT_LAUNCHED,
            f"{what}; relaunching (relaunch {unlaunched} of at most {limit})",
        )
    return Verdict(
        S.FAILED,
        C.NOT_LAUNCHED,
        f"{what}; not relaunched: {unlaunched} attempts could not launch",
    )


def node_lost(
    node: str, *, cancel_requested: bool, requeue_on_node_loss: bool
) -> Verdict:
    """A job whose node was lost: CANCELLED if a cancel was asked, else back to
    the queue or FAILED as the job asked."""
    if cancel_requested:
        to, cause = S.CANCELLED, C.CANCEL
    else:
        to, cause = (S.PENDING if requeue_on_node_loss else S.FAILED), C.NODE_LOST
    return Verdict(to, cause, f"node {node} lost; job {to}")
