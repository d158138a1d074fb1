"""``services.record_progress``: a job's reported steps kept on its attempt (latest
step, rate window), sampled once a minute, idempotent under replays, refused from a
node the attempt does not run on."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pytest

from agents import protocol
from scheduler import policy, services
from scheduler.models import Attempt, Job, Node, ProgressSample
from tests.factories import JobFactory, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

# The agent's clock, an hour behind the portal's (a report more than an hour ahead
# is refused); whole seconds, so stored times compare exactly.
T0 = float(int(time.time()) - 3600)


def report(
    attempt: Attempt, step: int, at: float, total: int | None = None
) -> protocol.JobProgressData:
    return protocol.JobProgressData(
        attempt_id=attempt.pk, job_id=attempt.job_id, at=at, step=step, total=total
    )


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=UTC)


@pytest.fixture
def attempt(alice: User, cluster: list[Node]) -> Attempt:
    node = cluster[0]
    attempt = start_job(JobFactory(owner=alice), node)
    assert services.mark_started(node.pk, started_data(attempt, T0))
    return attempt


def samples(attempt: Attempt) -> list[tuple[datetime, int]]:
    return list(
        ProgressSample.objects.filter(attempt=attempt)
        .order_by("at")
        .values_list("at", "step")
    )


def test_it_keeps_the_latest_step_and_the_rate_since_the_first_report(
    attempt: Attempt,
) -> None:
    node_id = attempt.node_id

    assert services.record_progress(node_id, report(attempt, 100, T0, 5000))
    attempt.refresh_from_db()
    assert attempt.progress_rate() is None  # one report: no rate yet
    assert services.record_progress(node_id, report(attempt, 130, T0 + 10, 5000))
    assert services.record_progress(node_id, report(attempt, 164, T0 + 20, 5000))

    attempt.refresh_from_db()
    assert (attempt.progress_step, attempt.progress_total) == (164, 5000)
    assert attempt.progress_at == at(20)
    assert (attempt.progress_first_step, attempt.progress_first_at) == (100, at(0))
    assert attempt.progress_rate() == pytest.approx(3.2)


def test_a_step_going_backwards_starts_the_rate_window_again(
    attempt: Attempt,
) -> None:
    node_id = attempt.node_id
    services.record_progress(node_id, report(attempt, 0, T0))
    services.record_progress(node_id, report(attempt, 500, T0 + 100))

    # The script restarted from its checkpoint at step 300.
    assert services.record_progress(node_id, report(attempt, 300, T0 + 130))
    attempt.refresh_from_db()
    assert (attempt.progress_first_step, attempt.progress_first_at) == (300, at(130))
    assert attempt.progress_rate() is None
    services.record_progress(node_id, report(attempt, 320, T0 + 140))

    attempt.refresh_from_db()
    assert attempt.progress_step == 320
    assert attempt.progress_rate() == pytest.approx(2.0)


def test_a_replayed_or_older_report_changes_nothing(attempt: Attempt) -> None:
    node_id = attempt.node_id
    first = report(attempt, 10, T0, 100)
    latest = report(attempt, 20, T0 + 10, 100)
    services.record_progress(node_id, first)
    services.record_progress(node_id, latest)
    attempt.refresh_from_db()
    stored = (
        attempt.progress_step,
        attempt.progress_at,
        attempt.progress_first_step,
        attempt.progress_first_at,
    )

    assert services.record_progress(node_id, latest) is False  # lost ack: replay
    assert services.record_progress(node_id, first) is False  # out of order

    attempt.refresh_from_db()
    assert stored == (
        attempt.progress_step,
        attempt.progress_at,
        attempt.progress_first_step,
        attempt.progress_first_at,
    )
    assert samples(attempt) == [(at(0), 10)]


def test_it_samples_the_step_at_most_once_a_minute(attempt: Attempt) -> None:
    for seconds in range(0, 200, 10):
        services.record_progress(
            attempt.node_id, report(attempt, seconds, T0 + seconds)
        )

    assert samples(attempt) == [
        (at(0), 0),
        (at(60), 60),
        (at(120), 120),
        (at(180), 180),
    ]


def test_it_refuses_a_report_about_another_nodes_attempt(
    attempt: Attempt, cluster: list[Node]
) -> None:
    other = cluster[1]

    with pytest.raises(services.FrameRefused, match="does not run on this node"):
        services.record_progress(other.pk, report(attempt, 5, T0))

    attempt.refresh_from_db()
    assert attempt.progress_step is None
    assert not ProgressSample.objects.exists()


def test_it_refuses_a_report_of_the_wrong_job(attempt: Attempt) -> None:
    wrong = protocol.JobProgressData(
        attempt_id=attempt.pk, job_id=attempt.job_id + 1, at=T0, step=5
    )

    with pytest.raises(services.FrameRefused):
        services.record_progress(attempt.node_id, wrong)

    assert not ProgressSample.objects.exists()


def test_it_refuses_a_report_from_over_an_hour_ahead(attempt: Attempt) -> None:
    ahead = datetime.now(UTC).timestamp() + 2 * 3600

    with pytest.raises(services.FrameRefused, match="ahead of the portal's clock"):
        services.record_progress(attempt.node_id, report(attempt, 5, ahead))

    attempt.refresh_from_db()
    assert attempt.progress_step is None


def test_it_keeps_rank_0s_progress_only(alice: User, cluster: list[Node]) -> None:
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    start = policy.Start(
        job.pk,
        (
            policy.Placement(a.pk, tuple(g.pk for g in a.gpus.order_by("index"))),
            policy.Placement(b.pk, tuple(g.pk for g in b.gpus.order_by("index"))),
        ),
    )
    assert services.apply_decisions([start]).started == 1
    attempt = Attempt.objects.get(job=job, ended_at__isnull=True)

    assert services.record_progress(a.pk, report(attempt, 40, T0)) is True
    assert services.record_progress(b.pk, report(attempt, 39, T0 + 1)) is False

    attempt.refresh_from_db()
    assert (attempt.progress_step, attempt.progress_at) == (40, at(0))
    assert Job.objects.get(pk=job.pk).status == Job.Status.STARTING


def test_the_rate_needs_time_between_two_reports(attempt: Attempt) -> None:
    attempt.progress_step, attempt.progress_first_step = 10, 5
    attempt.progress_at = attempt.progress_first_at = at(0)

    assert attempt.progress_rate() is None
