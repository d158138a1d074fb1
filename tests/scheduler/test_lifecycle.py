"""The job lifecycle: the table of allowed transitions pinned rule by rule, the
writer (``services.transition``) walked over every pair of states, the batch
start, the exit classification as a table, and a cancelled job whose process
catches SIGTERM and exits 0."""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.utils import timezone

from agents.launcher import Launcher
from agents.protocol import JobExitedData, JobLaunchData
from agents.statedir import StateDir
from scheduler import events, lifecycle, services
from scheduler.lifecycle import (
    TRANSITIONS,
    Cause,
    ExitFacts,
    ForbiddenTransition,
    classify_exit,
)
from scheduler.models import Job, JobEvent
from scheduler.services.common import request_pass
from scheduler.services.lifecycle import start_many
from tests.e2e.conftest import wait_until
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from pathlib import Path

    from django.contrib.auth.models import User

    from scheduler.models import Node

S = Job.Status
C = Cause
ON_NODE = (S.STARTING, S.RUNNING)

# The table as the lifecycle must have it: (from, to) -> (causes, wakes a pass).
EXPECTED: dict[tuple[S, S], tuple[set[Cause], bool]] = {
    (S.PENDING, S.HELD): ({C.HOLD}, True),
    (S.HELD, S.PENDING): ({C.RELEASE}, True),
    (S.PENDING, S.CANCELLED): ({C.CANCEL}, True),
    (S.HELD, S.CANCELLED): ({C.CANCEL}, True),
    (S.PENDING, S.STARTING): ({C.START}, False),
    (S.PENDING, S.FAILED): ({C.UNLAUNCHABLE}, False),
    (S.STARTING, S.RUNNING): ({C.AGENT_STARTED}, False),
    (S.PREEMPTED, S.PENDING): ({C.PREEMPTED}, True),
    **{
        (source, to): (causes, True)
        for source in ON_NODE
        for to, causes in {
            S.COMPLETED: {C.EXIT_OK},
            S.FAILED: {
                C.EXIT_ERROR,
                C.LAUNCH_FAILED,
                C.KILLED,
                C.PEER_FAILED,
                C.MEMORY_OVERRUN,
                C.NODE_LOST,
                C.PROCESS_LOST,
                C.NOT_LAUNCHED,
            },
            S.CANCELLED: {C.CANCEL, C.QUOTA},
            S.TIMEOUT: {C.TIME_LIMIT},
            S.PREEMPTED: {C.PREEMPTED},
            S.PENDING: {
                C.EVICTED,
                C.REQUEUE,
                C.NODE_LOST,
                C.PROCESS_LOST,
                C.NOT_LAUNCHED,
            },
        }.items()
    },
}

PAIRS = list(itertools.product(S, S))


# ------------------------------------------------------------------ the table


def test_the_table_holds_exactly_the_expected_transitions() -> None:
    assert {
        pair: (set(rule.causes), rule.wakes_pass) for pair, rule in TRANSITIONS.items()
    } == EXPECTED


@pytest.mark.parametrize(
    ("pair", "rule"),
    EXPECTED.items(),
    # the pair names the test: a set's order would differ between processes
    ids=[f"{source}->{to}" for source, to in EXPECTED],
)
def test_each_rule_allows_its_causes_and_only_them(
    pair: tuple[S, S], rule: tuple[set[Cause], bool]
) -> None:
    source, to = pair
    causes, wakes = rule
    for cause in Cause:
        if cause in causes:
            assert lifecycle.check(1, source, to, cause).wakes_pass is wakes
        else:
            with pytest.raises(ForbiddenTransition):
                lifecycle.check(1, source, to, cause)


def test_an_ended_job_never_changes_state() -> None:
    for source in Job.TERMINAL:
        assert not [pair for pair in TRANSITIONS if pair[0] == source]


def test_only_preempted_is_a_state_passed_through() -> None:
    assert {S.PREEMPTED} == lifecycle.PASSING


def test_the_error_names_the_job_the_states_the_cause_and_what_is_allowed() -> None:
    with pytest.raises(ForbiddenTransition) as caught:
        lifecycle.check(7, S.RUNNING, S.HELD, C.HOLD)

    text = str(caught.value)
    assert text.startswith("job #7: running -> held for cause 'hold' is not allowed")
    assert "completed (exit_ok)" in text
    assert (caught.value.source, caught.value.to, caught.value.cause) == (
        "running",
        "held",
        "hold",
    )


# ------------------------------------------------------------------ the writer


def _cause_for(source: S, to: S) -> Cause:
    """A cause the table allows for the pair, else one it forbids."""
    rule = TRANSITIONS.get((source, to))
    return min(rule.causes) if rule is not None else C.HOLD


@pytest.mark.django_db
@pytest.mark.parametrize(("source", "to"), PAIRS, ids=str)
def test_every_pair_of_states_is_allowed_or_refused_without_a_trace(
    alice: User, source: S, to: S
) -> None:
    job = JobFactory(owner=alice, status=source)
    cause = _cause_for(source, to)

    if (source, to) in TRANSITIONS:
        with transaction.atomic():
            event = services.transition(job, to, cause, "moved", source="system")
        job.refresh_from_db()
        assert job.status == to
        assert (event.from_status, event.to_status, event.message) == (
            source,
            to,
            "moved",
        )
        assert JobEvent.objects.filter(job=job).count() == 1
        assert (job.finished_at is not None) is (to in Job.TERMINAL)
    else:
        with pytest.raises(ForbiddenTransition), transaction.atomic():
            services.transition(job, to, cause, "moved", source="system")
        job.refresh_from_db()
        assert job.status == source
        assert not JobEvent.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_an_allowed_pair_with_a_cause_of_another_rule_is_refused(alice: User) -> None:
    job = JobFactory(owner=alice, status=S.RUNNING)

    with pytest.raises(ForbiddenTransition), transaction.atomic():
        services.transition(job, S.COMPLETED, C.EXIT_ERROR, "moved", source="agent")

    job.refresh_from_db()
    assert job.status == S.RUNNING
    assert not JobEvent.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_the_stored_state_is_checked_not_the_callers_copy(alice: User) -> None:
    job = JobFactory(owner=alice, status=S.PENDING)
    stale = Job.objects.get(pk=job.pk)
    with transaction.atomic():
        services.transition(job, S.CANCELLED, C.CANCEL, "cancelled", source="user")

    with (
        pytest.raises(ForbiddenTransition, match="cancelled -> held"),
        transaction.atomic(),
    ):
        services.transition(stale, S.HELD, C.HOLD, "held", source="user")
    assert JobEvent.objects.filter(job=job).count() == 1


def _receive(channel: str) -> dict[str, Any]:
    layer = get_channel_layer()

    async def one() -> dict[str, Any]:
        return dict(await asyncio.wait_for(layer.receive(channel), timeout=10))

    return async_to_sync(one)()


@pytest.mark.django_db
def test_an_end_tells_browsers_the_owner_and_asks_for_one_pass(
    alice: User, django_capture_on_commit_callbacks: Any
) -> None:
    from portal.notifications.models import Delivery

    job = JobFactory(owner=alice, status=S.RUNNING)
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(events.job_group(job.pk), channel)

    with (
        django_capture_on_commit_callbacks(execute=True) as callbacks,
        transaction.atomic(),
    ):
        services.transition(
            job, S.FAILED, C.EXIT_ERROR, "failed with exit code 2", source="agent"
        )
        # a second change in the same transaction asks for no second pass
        other = JobFactory(owner=alice, status=S.PENDING)
        services.transition(other, S.HELD, C.HOLD, "held", source="user")

    assert callbacks.count(request_pass) == 1
    message = _receive(channel)
    assert (message["type"], message["job_id"], message["status"]) == (
        "job.status",
        job.pk,
        "failed",
    )
    assert message["message"] == "failed with exit code 2"
    notice = Delivery.objects.get(user=alice, payload__job_id=job.pk)
    assert notice.payload["status"] == "failed"


@pytest.mark.django_db
def test_a_state_passed_through_is_recorded_but_not_announced(
    alice: User, django_capture_on_commit_callbacks: Any
) -> None:
    job = JobFactory(owner=alice, status=S.RUNNING)

    with django_capture_on_commit_callbacks() as callbacks, transaction.atomic():
        services.transition(job, S.PREEMPTED, C.PREEMPTED, "p", source="agent")

    assert callbacks == []
    assert JobEvent.objects.get(job=job).to_status == S.PREEMPTED


@pytest.mark.django_db
def test_a_start_that_asks_for_no_pass_registers_none(
    alice: User, django_capture_on_commit_callbacks: Any
) -> None:
    job = JobFactory(owner=alice, status=S.STARTING)

    with django_capture_on_commit_callbacks() as callbacks, transaction.atomic():
        services.transition(job, S.RUNNING, C.AGENT_STARTED, "r", source="agent")

    assert request_pass not in callbacks


# ------------------------------------------------------------------ batch start


@pytest.mark.django_db
def test_a_batch_start_moves_every_job_with_one_event_each(alice: User) -> None:
    jobs = [JobFactory(owner=alice) for _ in range(3)]

    with transaction.atomic():
        made = start_many(
            [(job, f"allocated {job.pk}", "starting") for job in jobs],
            at=timezone.now(),
        )

    assert len(made) == 3
    for job in jobs:
        job.refresh_from_db()
        assert (job.status, job.attempts) == (S.STARTING, 1)
        event = JobEvent.objects.get(job=job)
        assert (event.from_status, event.to_status) == (S.PENDING, S.STARTING)


@pytest.mark.django_db
def test_a_batch_start_of_a_job_no_longer_pending_changes_nothing(
    alice: User,
) -> None:
    jobs = [JobFactory(owner=alice) for _ in range(2)]
    Job.objects.filter(pk=jobs[1].pk).update(status=S.HELD)  # behind its back

    with (
        pytest.raises(ForbiddenTransition, match="held -> starting"),
        transaction.atomic(),
    ):
        start_many([(job, "allocated", "starting") for job in jobs], at=timezone.now())

    assert list(Job.objects.order_by("pk").values_list("status", flat=True)) == [
        S.PENDING,
        S.HELD,
    ]
    assert not JobEvent.objects.exists()


# ------------------------------------------------------------------ exits


def facts(reason: str = "exited", code: int | None = 0, **kw: Any) -> ExitFacts:
    return ExitFacts(
        reason=reason,
        exit_code=code,
        node="n1",
        reporting_node="n2",
        time_limit_s=3600,
        relaunch_max=2,
        **kw,
    )


EXITS = [
    # cancel asked: CANCELLED, however the process ended
    (facts(cancel_requested=True), S.CANCELLED, C.CANCEL, "cancelled; process stopped"),
    (
        facts("killed", 0, cancel_requested=True, kill_reason="cancelled"),
        S.CANCELLED,
        C.CANCEL,
        "cancelled; process stopped",
    ),
    (
        facts("killed", 137, cancel_requested=True, kill_reason="preempted"),
        S.CANCELLED,
        C.CANCEL,
        "cancelled; process stopped",
    ),
    (
        facts("timeout", 143, cancel_requested=True),
        S.CANCELLED,
        C.CANCEL,
        "cancelled; process stopped",
    ),
    # the server's kills
    (
        facts("killed", 143, kill_reason="preempted"),
        S.PREEMPTED,
        C.PREEMPTED,
        "preempted; process stopped (exit code 143)",
    ),
    (
        facts("exited", 0, kill_reason="preempted"),
        S.PREEMPTED,
        C.PREEMPTED,
        "preempted; process stopped (exit code 0)",
    ),
    (
        facts("killed", 143, kill_reason="evicted"),
        S.PENDING,
        C.EVICTED,
        "sent back to the queue (its age is kept): the scheduler ended its sharing"
        " of a GPU to keep a slowdown cap, for the reason above (exit code 143)",
    ),
    (
        facts("killed", 143, kill_reason="quota"),
        S.CANCELLED,
        C.QUOTA,
        "stopped by the scheduler: a hard quota of it is used up"
        " (GPULAB_QUOTA_OVERRUN=stop), exit code 143",
    ),
    (
        facts("killed", 143, kill_reason="requeued"),
        S.PENDING,
        C.REQUEUE,
        "sent back to the queue by an admin (its age is kept; exit code 143)",
    ),
    (
        facts("killed", 137, kill_reason="memory_overrun"),
        S.FAILED,
        C.MEMORY_OVERRUN,
        "stopped: it used more GPU memory than it declared on a shared GPU"
        " (exit code 137)",
    ),
    # rendezvous port busy: relaunched up to the limit, then failed
    (
        facts("port_busy", None, message="port 29501 busy", unlaunched=2),
        S.PENDING,
        C.NOT_LAUNCHED,
        "port 29501 busy on node n2; relaunching (relaunch 2 of at most 2)",
    ),
    (
        facts(
            "port_busy",
            None,
            message="port 29501 busy",
            unlaunched=3,
            kill_reason="peer_failed",
        ),
        S.FAILED,
        C.NOT_LAUNCHED,
        "port 29501 busy on node n2; not relaunched: 3 attempts could not launch",
    ),
    # time limit, by the agent or asked by the portal
    (
        facts("timeout", 143),
        S.TIMEOUT,
        C.TIME_LIMIT,
        "stopped at its time limit (1:00:00)",
    ),
    (
        facts("killed", 143, kill_reason="timeout"),
        S.TIMEOUT,
        C.TIME_LIMIT,
        "stopped at its time limit (1:00:00)",
    ),
    # a failed rank stopped this one
    (
        facts("killed", 143, kill_reason="peer_failed"),
        S.FAILED,
        C.PEER_FAILED,
        "a rank failed with exit code 143; the others were stopped",
    ),
    (
        facts("exited", 1, kill_reason="peer_failed"),
        S.FAILED,
        C.PEER_FAILED,
        "a rank failed with exit code 1; the others were stopped",
    ),
    # its own exit
    (facts("exited", 0), S.COMPLETED, C.EXIT_OK, "completed (exit code 0)"),
    (facts("exited", 3), S.FAILED, C.EXIT_ERROR, "failed with exit code 3"),
    (facts("exited", 139), S.FAILED, C.EXIT_ERROR, "failed with exit code 139"),
    (
        facts("killed", 143, kill_reason="stale"),
        S.FAILED,
        C.KILLED,
        "stopped (stale), exit code 143",
    ),
    (
        facts("launch_failed", None, message="no such directory /x"),
        S.FAILED,
        C.LAUNCH_FAILED,
        "could not be started: no such directory /x",
    ),
    (
        facts("launch_failed", None),
        S.FAILED,
        C.LAUNCH_FAILED,
        "could not be started: launch failed",
    ),
    # a node problem, not the user's: requeued unless the job asked not to be
    (
        facts("lost", None, message="the shim vanished"),
        S.PENDING,
        C.PROCESS_LOST,
        "requeued: the shim vanished on n1",
    ),
    (
        facts("never_started", None, requeue_on_node_loss=False),
        S.FAILED,
        C.PROCESS_LOST,
        "failed: process never_started on n1",
    ),
    (
        facts("killed", 143, message="cut off from the portal"),
        S.PENDING,
        C.PROCESS_LOST,
        "requeued: cut off from the portal on n1",
    ),
]


@pytest.mark.parametrize(("f", "to", "cause", "message"), EXITS)
def test_exit_classification(f: ExitFacts, to: S, cause: Cause, message: str) -> None:
    verdict = classify_exit(f)

    assert (verdict.to, verdict.cause, verdict.message) == (to, cause, message)
    # every verdict is a transition the table allows from a job on a node
    lifecycle.check(1, S.RUNNING, verdict.to, verdict.cause)


@pytest.mark.parametrize(
    ("wishes", "to", "cause"),
    [
        (
            {"cancel_requested": True, "requeue_on_node_loss": True},
            S.CANCELLED,
            C.CANCEL,
        ),
        (
            {"cancel_requested": True, "requeue_on_node_loss": False},
            S.CANCELLED,
            C.CANCEL,
        ),
        (
            {"cancel_requested": False, "requeue_on_node_loss": True},
            S.PENDING,
            C.NODE_LOST,
        ),
        (
            {"cancel_requested": False, "requeue_on_node_loss": False},
            S.FAILED,
            C.NODE_LOST,
        ),
    ],
)
def test_a_lost_node(wishes: dict[str, bool], to: S, cause: Cause) -> None:
    verdict = lifecycle.node_lost("n1", **wishes)
    assert (verdict.to, verdict.cause, verdict.message) == (
        to,
        cause,
        f"node n1 lost; job {to}",
    )


# ------------------------------------------------------------------ cancel + exit 0

CHECKPOINTING = (
    "trap 'echo saved > checkpoint; exit 0' TERM; echo ready > ready; "
    "while true; do sleep 0.1; done"
)


@pytest.mark.django_db
@pytest.mark.parametrize("reason", ["killed", "exited"])
def test_a_cancelled_job_that_exits_0_ends_cancelled(
    alice: User, cluster: list[Node], reason: str
) -> None:
    """The kill's SIGTERM reached it ("killed"), or it exited 0 on its own just
    before the kill arrived ("exited"): either way its owner asked to cancel it."""
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt))
    services.cancel_job(job.pk, by=alice)

    assert services.finish_attempt(node.pk, exited_data(attempt, 0, reason=reason))

    job.refresh_from_db()
    assert (job.status, job.exit_code) == (S.CANCELLED, 0)
    assert job.end_reason == "cancelled; process stopped"
    last = JobEvent.objects.filter(job=job).order_by("at", "id").last()
    assert last is not None
    assert (last.from_status, last.to_status) == (S.RUNNING, S.CANCELLED)


@pytest.mark.django_db
def test_a_cancelled_script_that_checkpoints_on_sigterm_and_exits_0_ends_cancelled(
    alice: User, cluster: list[Node], tmp_path: Path
) -> None:
    """A real process: the agent's launcher runs a script that traps SIGTERM,
    writes a checkpoint and exits 0; the kill of the cancel stops it; its
    outcome, as the agent reports it, ends the job CANCELLED, not COMPLETED."""
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt))
    services.cancel_job(job.pk, by=alice)
    state = StateDir(tmp_path / "state")
    state.ensure()
    launcher = Launcher(state, allow_root_jobs=True)
    run = launcher.launch(
        JobLaunchData(
            attempt_id=attempt.pk,
            attempt=attempt.number,
            job_id=job.pk,
            name=job.name,
            command=CHECKPOINTING,
            workdir=str(tmp_path),
            env={},
            gpu_uuids=[],
            grace_s=10,
        )
    )
    wait_until(lambda: (tmp_path / "ready").exists(), timeout=15, what="ready")

    launcher.kill(run, 10, "cancelled")
    outcome = wait_until(lambda: launcher.poll(run), timeout=15, what="the exit")

    assert (outcome.exit_code, outcome.reason) == (0, "killed")
    assert (tmp_path / "checkpoint").read_text() == "saved\n"
    services.finish_attempt(
        node.pk,
        JobExitedData(
            attempt_id=attempt.pk,
            job_id=job.pk,
            exit_code=outcome.exit_code,
            ended_at=outcome.ended_at,
            reason=outcome.reason,
            message=outcome.message,
        ),
    )
    job.refresh_from_db()
    assert (job.status, job.exit_code) == (S.CANCELLED, 0)
