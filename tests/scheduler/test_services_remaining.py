"""The pass reads a running job's reported progress: the snapshot fills
``RunningJob.progress`` from the attempt's reports, and the planned start a
waiting job is shown comes from that job's progress end (with the margin of
``remaining.shown_end``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from agents import protocol
from scheduler import services
from scheduler.models import Job
from scheduler.pass_runner import run_one_pass
from scheduler.policy.remaining import SHOWN_MARGIN_S, SHOWN_MARGIN_SHARE, Progress
from tests.conftest import make_node
from tests.factories import JobFactory, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

T0 = 0.0  # the attempt's start, an hour before each test (set by the fixture)


@pytest.fixture(autouse=True)
def _started_an_hour_ago() -> None:
    """An hour before the test runs, not before the module was imported."""
    global T0
    T0 = float(int(time.time()) - 3600)


def test_the_pass_plans_a_waiting_job_behind_the_progress_end(alice: User) -> None:
    node, _ = make_node("node-p", 2)
    running = JobFactory(owner=alice, gpus=2, time_limit_s=86400)
    attempt = start_job(running, node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    for step, at in ((100, T0 + 600), (1900, T0 + 3000)):  # 0.75 steps/s
        assert services.record_progress(
            node.pk,
            protocol.JobProgressData(
                attempt_id=attempt.pk, job_id=running.pk, at=at, step=step, total=5000
            ),
        )
    end = T0 + 3000 + 3100 / 0.75

    [view] = services.cluster_state().running
    assert view.progress == Progress(1900.0, 5000.0, T0 + 3000, 0.75)

    waiting = JobFactory(owner=alice, gpus=2)
    before = time.time()
    run_one_pass()
    after = time.time()
    waiting.refresh_from_db()
    assert waiting.status == Job.Status.PENDING
    assert waiting.est_start is not None
    # shown with the margin over the progress end, counted from the pass's now
    shown = waiting.est_start.timestamp()
    assert end + SHOWN_MARGIN_S + SHOWN_MARGIN_SHARE * (end - after) - 1 <= shown
    assert shown <= end + SHOWN_MARGIN_S + SHOWN_MARGIN_SHARE * (end - before) + 1


def test_a_job_without_reports_has_no_progress(alice: User) -> None:
    node, _ = make_node("node-q", 1)
    attempt = start_job(JobFactory(owner=alice), node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    [view] = services.cluster_state().running
    assert view.progress is None
