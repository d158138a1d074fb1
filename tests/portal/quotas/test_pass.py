"""Quotas in the scheduling pass: the snapshot carries them, a job over its hard
quota waits with the reason while others start, and with
``GPULAB_QUOTA_OVERRUN=stop`` a running job over it is stopped and ends CANCELLED."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest
from django.utils import timezone

from agents import protocol
from portal.quotas import alerts
from portal.quotas.models import QuotaAlert
from scheduler import pass_runner, policy, services
from scheduler.models import Job, JobEvent
from tests.factories import JobFactory, exited_data
from tests.portal.quotas.helpers import quota, run

if TYPE_CHECKING:
    from tests.capture import AgentFrames

H = timedelta(hours=1)

pytestmark = pytest.mark.django_db


def test_the_snapshot_carries_each_quota_with_its_use(
    cluster: Any, alice: Any, groups: Any, sent: AgentFrames
) -> None:
    now = timezone.now()
    q = quota(group=groups["vision"], gpu_hours=10, max_gpus=4, hard=False)
    run(alice, cluster[0], now - 3 * H, gpus=2)
    snap = services.snapshot(now)
    [view] = snap.cluster.quotas
    assert view == policy.QuotaView(
        id=q.pk,
        group="vision",
        hard=False,
        gpu_hours=10.0,
        used_gpu_hours=pytest.approx(6.0),  # type: ignore[arg-type]
        max_gpus=4,
        running_gpus=2,
        period="month",
        resets_at=q.period_bounds(now)[1].timestamp(),
    )
    assert [s.quota for s in snap.quotas] == [q]


def test_a_job_over_its_hard_quota_waits_with_the_reason_and_others_start(
    cluster: Any, alice: Any, charlie: Any, groups: Any, sent: AgentFrames
) -> None:
    now = timezone.now()
    quota(group=groups["vision"], gpu_hours=2)
    run(alice, cluster[0], now - 4 * H, now - 2 * H)  # 2 GPU-h used: exhausted
    held = JobFactory(owner=alice)
    other = JobFactory(owner=charlie)
    with mock.patch.object(alerts, "on_alert", autospec=True):
        result = pass_runner.run_one_pass()
    assert result["started"] == 1
    held.refresh_from_db()
    other.refresh_from_db()
    assert other.status == Job.Status.STARTING
    assert held.status == Job.Status.PENDING
    assert held.pending_reason == "quota"
    assert held.pending_message.startswith(
        "quota exhausted: group vision used 2.0 of its 2.0 GPU-hours this month"
        " (hard limit); it resets at "
    )
    # the pass recorded the 80 % and 100 % alerts
    assert result["quota_alerts"] == 2
    assert QuotaAlert.objects.count() == 2


def test_the_cap_holds_a_job_while_the_group_holds_its_gpus(
    cluster: Any, alice: Any, bob: Any, groups: Any, sent: AgentFrames
) -> None:
    quota(group=groups["vision"], max_gpus=2)
    run(alice, cluster[0], timezone.now() - H, gpus=2)
    job = JobFactory(owner=bob)
    pass_runner.run_one_pass()
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert job.pending_reason == "quota"
    assert "group vision may hold at most 2 GPUs at once; its jobs hold 2" in (
        job.pending_message
    )


@pytest.mark.parametrize("overrun", ["stop", "finish"])
def test_a_running_job_over_a_hard_quota_is_stopped_only_when_set(
    cluster: Any,
    alice: Any,
    groups: Any,
    sent: AgentFrames,
    settings: Any,
    overrun: str,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "quota_overrun": overrun}
    now = timezone.now()
    quota(group=groups["vision"], gpu_hours=3)
    attempt = run(alice, cluster[0], now - 4 * H)  # running, 4 GPU-h so far
    sent.clear()
    with (
        mock.patch.object(alerts, "on_alert", autospec=True),
        django_capture_on_commit_callbacks(execute=True),
    ):
        result = pass_runner.run_one_pass()
    job = Job.objects.get(pk=attempt.job_id)
    if overrun == "finish":
        assert result["quota_stopped"] == 0
        assert sent.calls() == []
        assert job.status == Job.Status.RUNNING
        return
    assert result["quota_stopped"] == 1
    [(_, command)] = sent.calls()
    frame = protocol.parse_server_message(json.dumps(command))
    assert frame.type == "job.kill"
    assert frame.data.reason == "quota"
    event = JobEvent.objects.filter(job=job).latest("id")
    assert event.message.startswith(
        "stopped: group vision used 4.0 of its 3.0 GPU-hours this month"
    )
    # a second pass does not stop it twice (it is already being stopped)
    sent.clear()
    with mock.patch.object(alerts, "on_alert", autospec=True):
        assert pass_runner.run_one_pass()["quota_stopped"] == 0
    assert sent.calls() == []

    attempt.refresh_from_db()
    services.finish_attempt(cluster[0].pk, exited_data(attempt, 143))
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED
    assert job.end_reason.startswith(
        "stopped by the scheduler: a hard quota of it is used up"
    )
    assert not Job.objects.filter(pk=job.pk, status=Job.Status.PENDING).exists()
