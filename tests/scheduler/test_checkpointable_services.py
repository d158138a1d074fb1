"""Checkpointable jobs in production: the request's rules, the kill a preemption
sends, the work a requeued attempt lost, and GPULAB_RESTART_COUNT at launch, on
the real database and the frames agents get through Redis."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from django.conf import settings
from django.core.exceptions import ValidationError

from agents import protocol
from scheduler import policy, services
from scheduler.models import Attempt, Job, JobEvent
from scheduler.services.jobs import JobRequest, validate_job_request
from tests.factories import JobFactory, start_job, started_data
from tests.scheduler.test_kill_resends import AgentInbox

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db

T0 = 1_800_000_000.0


def request(**fields: Any) -> JobRequest:
    return JobRequest(**{"name": "j", "command": "python t.py", **fields})


def errors_of(req: JobRequest) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as exc:
        validate_job_request(req, "alice")
    return exc.value.message_dict


def running(job: Job, node: Node, at: float = T0) -> Attempt:
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt, at))
    attempt.refresh_from_db()
    return attempt


def exit_at(attempt: Attempt, at: float, code: int = 0) -> protocol.JobExitedData:
    return protocol.JobExitedData(
        attempt_id=attempt.pk,
        job_id=attempt.job_id,
        exit_code=code,
        ended_at=at,
        reason="exited",
    )


def kills(sent: AgentFrames) -> list[protocol.JobKillData]:
    return [
        protocol.parse_server_message(json.dumps(f)).data  # type: ignore[misc]
        for _, f in sent.of_type("job.kill")
    ]


def signals_of(frames: list[protocol.ServerMessage]) -> list[tuple[str, int]]:
    return [
        (f.data.signal, f.data.grace_s)
        for f in frames
        if isinstance(f.data, protocol.JobKillData)
    ]


def launch_env(sent: AgentFrames) -> list[dict[str, str]]:
    return [f["data"]["env"] for _, f in sent.of_type("job.launch")]


# ------------------------------------------------------------------ the request


def test_a_request_is_not_checkpointable_by_default(cluster: list[Node]) -> None:
    cleaned = validate_job_request(request(), "alice")
    assert cleaned["checkpointable"] is False
    assert cleaned["checkpoint_signal"] == "TERM"
    assert cleaned["checkpoint_grace_s"] == 60


@pytest.mark.parametrize(
    ("given", "stored"),
    [("", "TERM"), ("USR1", "USR1"), ("sigusr2", "USR2"), (" INT ", "INT")],
)
def test_the_checkpoint_signal_is_stored_by_its_name(
    cluster: list[Node], given: str, stored: str
) -> None:
    cleaned = validate_job_request(
        request(checkpointable=True, checkpoint_signal=given), "alice"
    )
    assert cleaned["checkpoint_signal"] == stored


def test_bad_checkpoint_fields_are_named(cluster: list[Node]) -> None:
    errors = errors_of(
        request(checkpointable=True, checkpoint_signal="KILL", checkpoint_grace_s=-1)
    )
    assert errors["checkpoint_signal"] == [
        "Unknown checkpoint signal 'KILL'; choose one of: TERM, INT, USR1, USR2."
    ]
    assert "between 0 and 3600 seconds" in errors["checkpoint_grace_s"][0]
    assert "checkpoint_grace_s" in errors_of(
        request(checkpointable=True, checkpoint_grace_s=3601)
    )
    # Settings that only a checkpointable job uses, on one that is not.
    errors = errors_of(request(checkpoint_signal="USR1", checkpoint_grace_s=120))
    assert errors == {
        "checkpoint_signal": [
            "A checkpoint signal only applies to a checkpointable job."
        ],
        "checkpoint_grace_s": [
            "A checkpoint grace only applies to a checkpointable job."
        ],
    }


def test_submit_stores_the_checkpoint_fields(alice: User, cluster: list[Node]) -> None:
    job = services.submit_job(
        alice,
        request(checkpointable=True, checkpoint_signal="USR1", checkpoint_grace_s=120),
    )
    job.refresh_from_db()
    assert (job.checkpointable, job.checkpoint_signal, job.checkpoint_grace_s) == (
        True,
        "USR1",
        120,
    )


# ------------------------------------------------------------------ the kill


@pytest.mark.parametrize(
    ("checkpointable", "signal", "grace"),
    [(True, "USR1", 120), (False, "TERM", 30)],
)
def test_a_preemption_sends_the_checkpoint_signal_and_grace(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
    *,
    checkpointable: bool,
    signal: str,
    grace: int,
) -> None:
    victim = JobFactory(
        owner=alice,
        priority_class="best-effort",
        checkpointable=checkpointable,
        checkpoint_signal="USR1",
        checkpoint_grace_s=120,
        kill_grace_s=30,
    )
    running(victim, cluster[0])
    with django_capture_on_commit_callbacks(execute=True):
        services.apply_decisions([policy.Preempt(victim.pk, 999, "high waits")])
    [kill] = kills(sent)
    assert (kill.reason, kill.signal, kill.grace_s) == ("preempted", signal, grace)


def test_a_cancel_of_a_checkpointable_job_is_sigterm_with_its_stop_grace(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    job = JobFactory(
        owner=alice, checkpointable=True, checkpoint_signal="USR1", kill_grace_s=30
    )
    running(job, cluster[0])
    with django_capture_on_commit_callbacks(execute=True):
        services.cancel_job(job.pk, by=alice)
    [kill] = kills(sent)
    assert (kill.reason, kill.signal, kill.grace_s) == ("cancelled", "TERM", 30)


def test_a_lost_kill_is_resent_with_the_checkpoint_signal_after_its_grace(
    alice: User,
    cluster: list[Node],
    django_capture_on_commit_callbacks: Any,
) -> None:
    victim = JobFactory(
        owner=alice,
        priority_class="best-effort",
        checkpointable=True,
        checkpoint_signal="USR2",
        checkpoint_grace_s=600,
        kill_grace_s=5,
    )
    attempt = running(victim, cluster[0])
    inbox = AgentInbox(cluster[0].pk)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            services.apply_decisions([policy.Preempt(victim.pk, 999, "high waits")])
        attempt.refresh_from_db()
        assert attempt.kill_sent_at is not None
        assert signals_of(inbox.frames()) == [("USR2", 600)]
        due = attempt.kill_sent_at + timedelta(
            seconds=settings.GPULAB_KILL_RESEND_AFTER
        )
        # Within the checkpoint grace the job may still be saving: no re-send ...
        with time_machine.travel(due + timedelta(seconds=60), tick=False):
            assert services.resend_kills() == []
        # ... after it, the kill goes again, with the same signal and grace.
        with (
            time_machine.travel(due + timedelta(seconds=601), tick=False),
            django_capture_on_commit_callbacks(execute=True),
        ):
            assert services.resend_kills() == [attempt.pk]
        assert signals_of(inbox.frames()) == [("USR2", 600)]
    finally:
        inbox.close()


# ------------------------------------------------------------------ lost work


def test_a_preempted_checkpointable_job_loses_the_work_since_its_checkpoint(
    alice: User,
    cluster: list[Node],
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(
        owner=alice, priority_class="best-effort", gpus=2, checkpointable=True
    )
    attempt = running(job, node, at=T0)
    # Output with a checkpoint line reaches the portal 600 s in, with others.
    with time_machine.travel(datetime.fromtimestamp(T0 + 600, tz=UTC), tick=False):
        services.append_log(
            node.pk,
            protocol.JobLogData(
                attempt_id=attempt.pk,
                job_id=job.pk,
                offset=0,
                data="step 10\nGPULAB_CHECKPOINT saved ckpt-10.pt\nstep 11\n",
            ),
        )
    with django_capture_on_commit_callbacks(execute=True):
        services.apply_decisions([policy.Preempt(job.pk, 999, "high waits")])
        services.finish_attempt(node.pk, exit_at(attempt, T0 + 900))

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING  # requeued, not failed
    assert attempt.lost_work_gpu_s == 300 * 2  # since the checkpoint, on 2 GPUs
    assert JobEvent.objects.filter(
        job=job, message="attempt 1: 5 min of work lost since its last checkpoint"
    ).exists()


def test_a_job_that_is_not_checkpointable_loses_its_whole_attempt(
    alice: User,
    cluster: list[Node],
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, priority_class="best-effort")
    attempt = running(job, node, at=T0)
    # A checkpoint line counts only for a job that says it resumes from one.
    services.append_log(
        node.pk,
        protocol.JobLogData(
            attempt_id=attempt.pk, job_id=job.pk, offset=0, data="GPULAB_CHECKPOINT\n"
        ),
    )
    with django_capture_on_commit_callbacks(execute=True):
        services.apply_decisions([policy.Preempt(job.pk, 999, "high waits")])
        services.finish_attempt(node.pk, exit_at(attempt, T0 + 840, code=143))
    attempt.refresh_from_db()
    assert attempt.lost_work_gpu_s == 840


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("GPULAB_CHECKPOINT\n", True),
        ("a\n  GPULAB_CHECKPOINT step 5\n", True),
        ("x GPULAB_CHECKPOINT\n", False),  # not at a line's start
        ("GPULAB_CHECKPOINTS\n", False),  # a longer word
        ("GPULAB_PROGRESS 5\n", False),
    ],
)
def test_what_counts_as_a_checkpoint_line(text: str, *, found: bool) -> None:
    from scheduler.services.checkpoints import has_checkpoint

    assert has_checkpoint(text) is found


# ------------------------------------------------------------------ the restart


def test_a_resumed_job_is_told_its_restart_count(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, priority_class="best-effort", checkpointable=True)
    with django_capture_on_commit_callbacks(execute=True):
        first = running(job, node, at=T0)
    assert [e["GPULAB_RESTART_COUNT"] for e in launch_env(sent)] == ["0"]
    with django_capture_on_commit_callbacks(execute=True):
        services.apply_decisions([policy.Preempt(job.pk, 999, "high waits")])
        services.finish_attempt(node.pk, exit_at(first, T0 + 120))
    sent.clear()
    job.refresh_from_db()
    assert job.restarts() == (0, 120)  # requeued, not resumed yet

    with django_capture_on_commit_callbacks(execute=True):
        running(job, node, at=T0 + 200)
    assert [e["GPULAB_RESTART_COUNT"] for e in launch_env(sent)] == ["1"]
    job = Job.objects.get(pk=job.pk)
    assert job.restarts() == (1, 120)
    assert job.checkpoint_summary == "resumed 1 time, 2 min of work lost"
