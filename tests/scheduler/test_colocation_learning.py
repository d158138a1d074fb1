"""Co-location learns in production: solo rates, sharing episodes observed from the
progress jobs report, measured slowdowns, and a harmful pair evicted and refused."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.utils import timezone

from scheduler import pass_runner, services
from scheduler.models import Attempt, InterferencePair, Job, ProgressSample
from scheduler.services import interference
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, shared_start, start_job

if TYPE_CHECKING:
    from datetime import datetime

    from django.contrib.auth.models import User

    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db

MIN = timedelta(minutes=1)


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(0, 0), (10, 100)], 10.0),  # 6,000 steps in 10 min
        ([(0, 0)], None),  # one report
        ([(0, 0), (1, 10)], None),  # under two minutes apart
        ([(0, 0), (5, 50), (8, 10)], None),  # restarted from a checkpoint
        ([(-5, 0), (0, 0), (10, 100)], 10.0),  # reports before the window skipped
    ],
)
def test_a_rate_needs_two_reports_minutes_apart_going_forward(
    points: list[tuple[int, int]], expected: float | None
) -> None:
    t0 = timezone.now()
    pts = [(t0 + m * MIN, step * 60) for m, step in points]
    got = interference.rate(pts, t0, t0 + 30 * MIN)
    assert got == (None if expected is None else pytest.approx(expected))


def history(workload: str, solo: float, alice: User) -> None:
    """A finished attempt of ``workload`` that ran alone at ``solo`` steps/s."""
    job = JobFactory(owner=alice, workload=workload, status=Job.Status.COMPLETED)
    Attempt.objects.create(
        job=job, number=1, node=make_node(f"old-{workload}", 0)[0],
        ended_at=timezone.now() - timedelta(days=1), solo_rate=solo,
    )  # fmt: skip


def reports(attempt: Attempt, t0: datetime, per_minute: float, minutes: int) -> None:
    """The progress the agent would have stored: a sample a minute, and the
    latest report on the attempt."""
    for m in range(minutes + 1):
        ProgressSample.objects.create(
            attempt=attempt, at=t0 + m * MIN, step=round(per_minute * m)
        )
    Attempt.objects.filter(pk=attempt.pk).update(
        progress_step=round(per_minute * minutes),
        progress_at=t0 + minutes * MIN,
        progress_first_step=0,
        progress_first_at=t0,
    )


@pytest.fixture
def sharing(alice: User, bob: User) -> tuple[Attempt, Attempt, Any, Any]:
    """rn18 (2 steps/s alone) and lm (1 step/s alone) share one GPU for 10 min,
    rn18 running at 1 step/s (2x slower), lm at 0.8 (1.25x slower)."""
    history("rn18", 2.0, alice)
    history("lm", 1.0, alice)
    node, _ = make_node("node-a", 1)
    first = JobFactory(
        owner=alice, shareable=True, workload="rn18", gpu_memory_mib=4096
    )
    start_job(first, node)
    later = JobFactory(owner=bob, shareable=True, workload="lm", gpu_memory_mib=4096)
    services.apply_decisions(
        [shared_start(later, node.gpus.get().pk, node.pk, (first.pk,))]
    )
    a, b = (Attempt.objects.get(job=j) for j in (first, later))
    t0 = timezone.now() - 10 * MIN
    Attempt.objects.filter(pk__in=[a.pk, b.pk]).update(
        created_at=t0, shared_at=t0, started_at=t0
    )
    reports(a, t0, 60.0, 10)
    reports(b, t0, 48.0, 10)
    a.refresh_from_db()
    b.refresh_from_db()
    return a, b, node, t0


def test_a_shared_start_marks_both_attempts_as_sharing(alice: User, bob: User) -> None:
    node, _ = make_node("node-a", 1)
    first = JobFactory(owner=alice, shareable=True)
    start_job(first, node)
    later = JobFactory(owner=bob, shareable=True)
    services.apply_decisions(
        [shared_start(later, node.gpus.get().pk, node.pk, (first.pk,))]
    )

    shared = Attempt.objects.filter(shared_at__isnull=False)
    assert set(shared.values_list("job_id", flat=True)) == {first.pk, later.pk}


def test_an_attempt_alone_keeps_its_solo_rate(alice: User) -> None:
    node, _ = make_node("node-a", 1)
    attempt = start_job(JobFactory(owner=alice, workload="rn18"), node)
    t0 = timezone.now() - 10 * MIN
    reports(attempt, t0, 90.0, 10)
    attempt.refresh_from_db()

    services.finish_attempt(node.pk, exited_data(attempt, 0))

    assert Attempt.objects.get(pk=attempt.pk).solo_rate == pytest.approx(1.5)
    assert interference.solo_rates(["rn18"]) == {"rn18": pytest.approx(1.5)}


def test_the_end_of_an_episode_is_observed_once_each_way(
    sharing: tuple[Attempt, Attempt, Any, Any],
) -> None:
    a, _b, node, t0 = sharing

    services.finish_attempt(node.pk, exited_data(a, 0, at=(t0 + 10 * MIN).timestamp()))

    rows = {(p.workload_a, p.workload_b): p for p in InterferencePair.objects.all()}
    assert rows["rn18", "lm"].n == 1
    assert rows["rn18", "lm"].slowdown == pytest.approx(2.0)
    assert rows["lm", "rn18"].slowdown == pytest.approx(1.25)
    # the snapshot's knowledge carries them to the policy
    knowledge, _ = services.load_knowledge(timezone.now())
    assert knowledge.pairs["rn18", "lm"].mean == pytest.approx(math.log(2.0))


def test_observations_merge_as_mean_and_variance() -> None:
    for x in (0.1, 0.3, 0.2):
        interference.observe("a", "b", x)

    row = InterferencePair.objects.get()
    assert (row.n, row.mean_log) == (3, pytest.approx(0.2))
    assert row.m2 / (row.n - 1) == pytest.approx(0.01)


def test_a_pair_measured_over_its_cap_is_evicted_and_never_admitted_again(
    sharing: tuple[Attempt, Attempt, Any, Any], alice: User, sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    a, b, node, _t0 = sharing
    running = {r.id: r for r in services.cluster_state().running}
    assert running[a.job_id].measured_slowdown == pytest.approx(2.0)
    assert running[a.job_id].measured_for_s == pytest.approx(600.0)

    with django_capture_on_commit_callbacks(execute=True):
        pass_runner.run_one_pass()

    kills = [frame["data"] for _, frame in sent.of_type("job.kill")]
    assert [(k["job_id"], k["reason"]) for k in kills] == [(b.job_id, "evicted")]
    services.finish_attempt(node.pk, exited_data(b, 143, reason="killed"))
    assert Job.objects.get(pk=b.job_id).status == Job.Status.PENDING

    # the evicted job (and any other lm job) is not put beside rn18 again
    pass_runner.run_one_pass()
    waiting = Job.objects.get(pk=b.job_id)
    assert waiting.status == Job.Status.PENDING
    assert "not admitted again until an admin resets it" in waiting.pending_message
