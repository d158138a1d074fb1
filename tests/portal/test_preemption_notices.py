"""A preemption as people see it: the queue's running row and the job page of a
job chosen as a preemption's victim say whom it yields to and when it is
stopped; its owner is told once it is back in the queue (by the channels and
events they chose), with the work it lost."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine

from agents import protocol
from portal.cli import output
from portal.notifications.models import Delivery, Kind, Preference
from scheduler import policy, services
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

    from scheduler.models import Attempt, Job, Node

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def running(job: Job, node: Node, at: datetime) -> Attempt:
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt, at.timestamp()))
    return attempt


@pytest.fixture
def victim(alice: User, bob: User, cluster: list[Node]) -> tuple[Job, Job, Attempt]:
    """alice's checkpointable job (SIGUSR1, 120 s grace) ran 20 min; bob's job
    waits; the pass preempts alice's for bob's at NOW."""
    job = JobFactory(
        owner=alice,
        name="train",
        checkpointable=True,
        checkpoint_signal="USR1",
        checkpoint_grace_s=120,
    )
    waiting = JobFactory(owner=bob, name="needs-gpus")
    attempt = running(job, cluster[0], NOW - timedelta(minutes=20))
    return job, waiting, attempt


def preempt(job: Job, waiting: Job, capture: Any, when: datetime = NOW) -> None:
    with time_machine.travel(when, tick=False), capture(execute=True):
        services.apply_decisions([policy.Preempt(job.pk, waiting.pk, "waits")])


def test_the_queue_says_whom_a_victim_yields_to_and_when(
    client: Client,
    bob: User,
    victim: tuple[Job, Job, Attempt],
    django_capture_on_commit_callbacks: Any,
) -> None:
    job, waiting, attempt = victim
    client.force_login(bob)
    assert 'data-testid="yielding"' not in client.get("/queue/").content.decode()

    preempt(job, waiting, django_capture_on_commit_callbacks)
    attempt.refresh_from_db()
    assert attempt.preempted_for_id == waiting.pk
    with time_machine.travel(NOW + timedelta(seconds=30), tick=False):
        client.force_login(bob)
        html = client.get("/queue/").content.decode()
    assert (
        f'<span class="muted" data-testid="yielding">will be preempted for job'
        f" #{waiting.pk} in about 1m 30s (SIGUSR1 sent: it may save its work until"
        " then)</span>"
    ) in html


def test_the_queue_api_and_the_cli_say_it_too(
    client: Client,
    bob: User,
    victim: tuple[Job, Job, Attempt],
    django_capture_on_commit_callbacks: Any,
) -> None:
    job, waiting, _ = victim
    preempt(job, waiting, django_capture_on_commit_callbacks)
    with time_machine.travel(NOW + timedelta(seconds=30), tick=False):
        client.force_login(bob)
        rows = {row["id"]: row for row in client.get("/api/v1/queue/").json()}
    assert (rows[job.pk]["preempted_for"], rows[job.pk]["preempted_in_s"]) == (
        waiting.pk,
        pytest.approx(90),
    )
    assert (rows[waiting.pk]["preempted_for"], rows[waiting.pk]["preempted_in_s"]) == (
        None,
        None,
    )
    assert output.where(rows[job.pk]) == f"node-a (preempted for {waiting.pk})"


def test_the_job_page_says_it_too_and_nothing_once_requeued(
    client: Client,
    alice: User,
    cluster: list[Node],
    victim: tuple[Job, Job, Attempt],
    django_capture_on_commit_callbacks: Any,
) -> None:
    job, waiting, attempt = victim
    preempt(job, waiting, django_capture_on_commit_callbacks)
    with time_machine.travel(NOW + timedelta(seconds=150), tick=False):
        client.force_login(alice)
        html = client.get(f"/jobs/{job.pk}/").content.decode()
    # Past its grace: due now (the kill is re-sent if no exit came back).
    assert f"will be preempted for job #{waiting.pk} in about 0s" in html

    assert services.finish_attempt(
        cluster[0].pk,
        exited_data(attempt, 0, at=(NOW + timedelta(seconds=40)).timestamp()),
    )
    with time_machine.travel(NOW + timedelta(seconds=160), tick=False):
        client.force_login(alice)
        html = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-testid="yielding"' not in html
    assert "resumed 0 times, 21 min of work lost" in html  # no checkpoint reported


def test_the_owner_is_told_whom_it_yielded_to_and_what_was_lost(
    alice: User,
    cluster: list[Node],
    victim: tuple[Job, Job, Attempt],
    django_capture_on_commit_callbacks: Any,
) -> None:
    job, waiting, attempt = victim
    node = cluster[0]
    # A checkpoint 5 min before the preemption.
    with time_machine.travel(NOW - timedelta(minutes=5), tick=False):
        services.append_log(
            node.pk,
            protocol.JobLogData(
                attempt_id=attempt.pk,
                job_id=job.pk,
                offset=0,
                data="GPULAB_CHECKPOINT\n",
            ),
        )
    preempt(job, waiting, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks():
        assert services.finish_attempt(
            node.pk,
            exited_data(attempt, 0, at=(NOW + timedelta(seconds=60)).timestamp()),
        )

    [notice] = Delivery.objects.filter(kind=Kind.JOB_PREEMPTED)
    assert notice.user_id == alice.pk
    assert notice.subject == f"Job #{job.pk} train preempted"
    assert notice.text.startswith(
        f"Job #{job.pk} (train) preempted: preempted; process stopped (exit code 0);"
        f" its GPUs went to job #{waiting.pk}; 6 min of work lost since its last"
        " checkpoint (charged to nobody's quota); it waits in the queue to resume"
        " from its last checkpoint"
    )
    assert notice.payload["job_id"] == job.pk
    assert notice.payload["status"] == "pending"  # back in the queue
    # The move back to the queue right after is not a second notice.
    assert Delivery.objects.filter(payload__job_id=job.pk).count() == 1


def test_an_owner_who_chose_other_events_is_not_told(
    alice: User,
    cluster: list[Node],
    victim: tuple[Job, Job, Attempt],
    django_capture_on_commit_callbacks: Any,
) -> None:
    Preference.objects.create(user=alice, kinds=[Kind.JOB_FAILED])
    job, waiting, attempt = victim
    preempt(job, waiting, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks():
        assert services.finish_attempt(
            cluster[0].pk,
            exited_data(attempt, 0, at=(NOW + timedelta(seconds=60)).timestamp()),
        )
    assert not Delivery.objects.exists()


def test_the_preferences_page_offers_it_and_saves_it(
    client: Client, alice: User
) -> None:
    client.force_login(alice)
    page = client.get("/notifications/").content.decode()
    assert 'value="job_preempted"' in page
    assert "job preempted (back in the queue)" in page
    response = client.post(
        "/notifications/", {"kinds": ["job_preempted"], "email_enabled": "on"}
    )
    assert response.status_code in (200, 302)
    assert Preference.objects.get(user=alice).kinds == ["job_preempted"]
