"""Guests in production (``GPULAB_GUEST_BACKFILL``): the pass's guest start is
kept on the attempt (``Attempt.guest``), the snapshot hands it back to the
policy, the job page says so, and when the job whose reservation it took can
start, the guest is preempted through the usual path (the kill frame with its
checkpoint signal, the requeue) and that job starts; on the real database and
the frames agents get through Redis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.urls import reverse

from scheduler import policy, services
from scheduler.models import Attempt, Job
from scheduler.services.snapshot import policy_config
from tests.factories import JobFactory, started_data
from tests.portal.test_job_views import client_for
from tests.scheduler.test_checkpointable_services import T0, exit_at, kills, running
from tests.scheduler.test_las_services import at

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db


def starts_of(decisions: list[Any]) -> dict[int, policy.Start]:
    return {d.job_id: d for d in decisions if isinstance(d, policy.Start)}


def test_the_setting_reaches_the_policy(settings: Any) -> None:
    assert policy_config().guest_backfill == "off"
    settings.GPULAB_GUEST_BACKFILL = "predicted"
    assert policy_config().guest_backfill == "predicted"


def test_a_guest_runs_on_reserved_gpus_and_yields_them_when_their_job_can_start(
    settings: Any,
    alice: User,
    bob: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.GPULAB_GUEST_BACKFILL = "on"
    node_a, node_b = cluster
    # node-a (4 GPUs): a 2-GPU job with a 2-h limit; node-b (2 GPUs): full
    blocker = JobFactory(owner=alice, gpus=2, time_limit_s=2 * 3600)
    first = running(blocker, node_a, at=T0)
    running(JobFactory(owner=alice, gpus=2, time_limit_s=10 * 3600), node_b, at=T0)
    # bob's 4-GPU job can only go on node-a, at the blocker's end; his 5-h
    # checkpointable job fits node-a's two free GPUs now, past that end
    wide = JobFactory(owner=bob, gpus=4, time_limit_s=3600, submitted_at=at(0))
    late = JobFactory(
        owner=bob,
        gpus=1,
        time_limit_s=5 * 3600,
        submitted_at=at(60),
        checkpointable=True,
        checkpoint_signal="USR1",
        checkpoint_grace_s=90,
    )
    decisions = policy.decide(services.cluster_state(at(600)))
    start = starts_of(decisions)[late.pk]
    assert start.guest
    services.apply_decisions(decisions)
    attempt = Attempt.objects.get(job=late, ended_at__isnull=True)
    assert attempt.guest and attempt.node_id == node_a.pk
    assert services.mark_started(node_a.pk, started_data(attempt, T0 + 600))
    [r] = [r for r in services.cluster_state(at(900)).running if r.id == late.pk]
    assert r.guest and r.checkpointable
    # the owner reads it on the job's page
    page = client_for(bob).get(reverse("portal-job", args=[late.pk]))
    assert b'data-testid="guest"' in page.content
    assert b"it yields them" in page.content
    # and through the API (the CLI's ``show`` reads it there)
    assert client_for(bob).get(f"/api/v1/jobs/{late.pk}/").json()["guest"] is True
    # no guest mark on an ordinary start
    plain = client_for(alice).get(reverse("portal-job", args=[blocker.pk]))
    assert b'data-testid="guest"' not in plain.content

    # the blocker ends after an hour: the wide job could start but for the guest
    with django_capture_on_commit_callbacks(execute=True):
        services.finish_attempt(node_a.pk, exit_at(first, T0 + 3600))
    decisions = policy.decide(services.cluster_state(at(3660)))
    [p] = [d for d in decisions if isinstance(d, policy.Preempt)]
    assert (p.victim_id, p.for_job_id) == (late.pk, wide.pk)
    assert "guest" in p.reason
    assert wide.pk not in starts_of(decisions)
    with django_capture_on_commit_callbacks(execute=True):
        services.apply_decisions(decisions)
    [kill] = kills(sent)
    assert (kill.reason, kill.signal, kill.grace_s) == ("preempted", "USR1", 90)
    with django_capture_on_commit_callbacks(execute=True):
        services.finish_attempt(node_a.pk, exit_at(attempt, T0 + 3700))
    late.refresh_from_db()
    assert late.status == Job.Status.PENDING
    assert client_for(bob).get(f"/api/v1/jobs/{late.pk}/").json()["guest"] is False
    state = services.cluster_state(at(3710))
    assert not any(r.id == late.pk for r in state.running)
    decisions = policy.decide(state)
    assert wide.pk in starts_of(decisions)
    assert late.pk not in starts_of(decisions)
