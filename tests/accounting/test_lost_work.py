"""Work lost to preemption in accounting: a requeued attempt's run after its last
checkpoint (or its whole run) is charged to nobody, through the services an
agent's reports call. It is kept apart on the usage records and their days, is
not in the quotas' usage nor in fair share, survives a neighbour's recharge
unchanged, and is its own line in the user's, the group's and the admin's usage
reports (page, CSV, API, CLI)."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from django.conf import settings
from django.db.models import Sum

from agents import protocol
from portal.accounting import reports
from portal.accounting.models import DailyUsage
from portal.cli import output
from portal.quotas.usage import quota_states
from scheduler import policy, services
from scheduler.models import Attempt, Group, Job, Membership, UsageRecord
from scheduler.services.snapshot import decayed_usage
from tests.accounting.test_charges import GIB, T0, end, join, run_alone
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data
from tests.portal.quotas.helpers import quota

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

    from scheduler.models import Node

pytestmark = pytest.mark.django_db

DAY = "from=2027-01-15&to=2027-01-15"  # T0's UTC day


def at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def checkpoint(node: Node, attempt: Attempt, when: float, offset: int = 0) -> None:
    """The job's output with a checkpoint line reaches the portal at ``when``."""
    with time_machine.travel(at(when), tick=False):
        services.append_log(
            node.pk,
            protocol.JobLogData(
                attempt_id=attempt.pk,
                job_id=attempt.job_id,
                offset=offset,
                data="step 10\nGPULAB_CHECKPOINT ckpt-10.pt\n",
            ),
        )


def preempt(node: Node, attempt: Attempt, for_job: int, ended: float) -> None:
    """The scheduler preempts the attempt's job for ``for_job``; its agent reports
    the exit at ``ended``."""
    services.apply_decisions([policy.Preempt(attempt.job_id, for_job, "waits")])
    assert services.finish_attempt(
        node.pk, exited_data(attempt, 143, at=ended, reason="killed")
    )


def totals(job: Job) -> tuple[float, float]:
    got = UsageRecord.objects.filter(attempt__job=job).aggregate(
        charged=Sum("gpu_seconds"), lost=Sum("lost_gpu_seconds")
    )
    return got["charged"], got["lost"]


@pytest.fixture
def preempted(alice: User, bob: User, cluster: list[Node]) -> Job:
    """alice's checkpointable job on 2 GPUs: started at T0, checkpointed at
    T0+600, preempted for bob's job and stopped at T0+900 (300 s lost on each
    GPU), then resumed from T0+1000 to T0+1600 and completed."""
    node = cluster[0]
    job = JobFactory(owner=alice, gpus=2, checkpointable=True, name="train")
    waiting = JobFactory(owner=bob, gpus=4)
    first = run_alone(job, node, T0)
    checkpoint(node, first, T0 + 600)
    preempt(node, first, waiting.pk, T0 + 900)
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    second = run_alone(job, node, T0 + 1000)
    end(node, second, T0 + 1600)
    return job


def test_the_work_since_the_checkpoint_is_kept_apart_from_the_charge(
    preempted: Job,
) -> None:
    first, second = Attempt.objects.filter(job=preempted).order_by("number")
    assert first.lost_since == at(T0 + 600)
    assert first.lost_work_gpu_s == 2 * 300
    # Per GPU: 600 s charged (start to checkpoint), 300 s lost (checkpoint to end).
    assert (
        sorted(
            UsageRecord.objects.filter(attempt=first).values_list(
                "gpu_seconds", "lost_gpu_seconds", "share"
            )
        )
        == [(pytest.approx(600), pytest.approx(300), pytest.approx(1.0))] * 2
    )
    assert totals(preempted) == (pytest.approx(2 * 600 + 2 * 600), pytest.approx(600))
    # The days say the same as their records.
    days = DailyUsage.objects.filter(job_id=preempted.pk).aggregate(
        charged=Sum("gpu_seconds"), lost=Sum("lost_gpu_seconds")
    )
    assert days == {"charged": pytest.approx(2400), "lost": pytest.approx(600)}
    assert second.lost_since is None


def test_a_job_preempted_before_any_checkpoint_loses_its_whole_attempt(
    alice: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, checkpointable=True)
    attempt = run_alone(job, node, T0)
    preempt(node, attempt, 999, T0 + 420)
    assert totals(job) == (0, pytest.approx(420))


@pytest.mark.parametrize("kill_reason", ["evicted", "requeued"])
def test_an_eviction_or_an_admins_requeue_is_not_charged_either(
    alice: User, cluster: list[Node], kill_reason: str
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = run_alone(job, node, T0)
    Attempt.objects.filter(pk=attempt.pk).update(kill_reason=kill_reason)
    end(node, attempt, T0 + 100, reason="killed")
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert totals(job) == (0, pytest.approx(100))


def test_a_lost_process_is_charged_for_what_it_ran(
    alice: User, cluster: list[Node]
) -> None:
    # Not the scheduler's choice: requeued, its loss recorded for the job page,
    # but charged as an attempt ended when its node was declared lost is.
    node = cluster[0]
    job = JobFactory(owner=alice, requeue_on_node_loss=True, checkpointable=True)
    attempt = run_alone(job, node, T0)
    end(node, attempt, T0 + 100, reason="lost")
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert (attempt.lost_work_gpu_s, attempt.lost_since) == (100, None)
    assert totals(job) == (pytest.approx(100), 0)


def test_lost_work_counts_against_no_quota_and_not_in_fair_share(
    preempted: Job, alice: User
) -> None:
    vision = Group.objects.get(name="vision")
    group_quota = quota(group=vision, gpu_hours=10)
    user_quota = quota(user=alice, gpu_hours=10)
    states = {
        s.quota.pk: s for s in quota_states(now=at(T0 + 2000), quotas=[group_quota])
    }
    states |= {s.quota.pk: s for s in quota_states(at(T0 + 2000), [user_quota])}
    # 2400 GPU-s charged (not the 3000 s the GPUs ran for it).
    assert states[group_quota.pk].used_gpu_hours == pytest.approx(2400 / 3600)
    assert states[user_quota.pk].used_gpu_hours == pytest.approx(2400 / 3600)
    # Fair share at the resumed attempt's end: nothing decayed from T0+1600 on;
    # the first attempt's charge (ended at T0+900) decays a little, the lost part
    # is not there at all.
    usage = decayed_usage(at(T0 + 1600), {})
    half_life = float(settings.GPULAB_FAIRSHARE_HALF_LIFE)

    def decayed(seconds: float, ended: float) -> float:
        return seconds * 2 ** (-(T0 + 1600 - ended) / half_life)

    expected = decayed(1200, T0 + 900) + 1200
    assert usage.group_usage["vision"] == pytest.approx(expected, rel=1e-6)


def test_a_neighbours_recharge_keeps_the_lost_part(alice: User, bob: User) -> None:
    # One 80 GiB GPU, half each: alice's A alone from T0, bob's B joins at +100;
    # A checkpoints at +200 and is preempted at +300; B ends at +400, which
    # charges A again from the runs.
    node, _ = make_node("node-s", 1)
    gpu = node.gpus.get()
    a = JobFactory(
        owner=alice, shareable=True, gpu_memory_mib=40 * GIB, checkpointable=True
    )
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=40 * GIB)
    first = run_alone(a, node, T0)
    second = join(b, gpu, node, a, T0 + 100)
    checkpoint(node, first, T0 + 200)
    preempt(node, first, 999, T0 + 300)
    before = UsageRecord.objects.get(attempt=first)
    assert (before.gpu_seconds, before.lost_gpu_seconds) == (
        pytest.approx(100 + 50),
        pytest.approx(50),
    )
    end(node, second, T0 + 400)
    after = UsageRecord.objects.get(attempt=first)
    assert (after.gpu_seconds, after.lost_gpu_seconds) == (
        pytest.approx(150),
        pytest.approx(50),
    )
    # B pays its share while they ran together, whether A's part was kept or lost.
    assert UsageRecord.objects.get(attempt=second).gpu_seconds == pytest.approx(200)
    # Charged and lost add up to the time the GPU ran something, once.
    held = UsageRecord.objects.aggregate(
        s=Sum("gpu_seconds"), lost=Sum("lost_gpu_seconds")
    )
    assert held["s"] + held["lost"] == pytest.approx(400)


# ------------------------------------------------------------------ the reports


def lead(user: User, group: str) -> None:
    Membership.objects.filter(user=user, group__name=group).update(is_leader=True)


def test_the_usage_page_shows_the_lost_work_as_its_own_line(
    client: Client, alice: User, preempted: Job
) -> None:
    client.force_login(alice)
    response = client.get(f"/usage/?{DAY}")
    assert response.status_code == 200
    report = response.context["report"]
    assert report.gpu_hours == pytest.approx(2400 / 3600, abs=1e-4)  # rounded per day
    assert report.lost_gpu_hours == pytest.approx(600 / 3600)
    assert [(r["job"].pk, round(r["gpu_hours"], 4)) for r in report.lost_jobs] == [
        (preempted.pk, round(600 / 3600, 4))
    ]
    html = response.content.decode()
    assert '<dd id="usage-lost">0.2</dd>' in html
    assert 'id="lost-jobs"' in html
    assert f"#{preempted.pk} train</a>" in html


def test_the_groups_report_and_its_leader_see_it(
    client: Client, alice: User, bob: User, preempted: Job
) -> None:
    lead(bob, "vision")
    client.force_login(bob)
    report = client.get(f"/usage/?group=vision&{DAY}").context["report"]
    assert report.lost_gpu_hours == pytest.approx(600 / 3600)
    # bob's own report has none: the lost work is alice's job's.
    own = reports.report(
        reports.Scope(user_id=bob.pk), at(T0).date(), at(T0).date(), at(T0 + 2000)
    )
    assert own.lost_gpu_hours == 0
    assert own.lost_jobs == []


def test_the_csv_has_a_lost_column(client: Client, alice: User, preempted: Job) -> None:
    client.force_login(alice)
    response = client.get(f"/usage/csv/?{DAY}")
    rows = list(
        csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode()))
    )
    by_attempt = {}
    for row in rows:
        by_attempt.setdefault(row["attempt"], []).append(
            (float(row["gpu_hours"]), float(row["lost_gpu_hours"]))
        )
    assert by_attempt == {
        "1": [
            (pytest.approx(600 / 3600, abs=1e-6), pytest.approx(300 / 3600, abs=1e-6))
        ]
        * 2,
        "2": [(pytest.approx(600 / 3600, abs=1e-6), 0.0)] * 2,
    }


def test_the_api_and_the_cli_report_the_lost_work(
    client: Client, alice: User, preempted: Job
) -> None:
    client.force_login(alice)
    got: dict[str, Any] = client.get(f"/api/v1/usage/?{DAY}").json()
    assert got["gpu_hours"] == pytest.approx(2400 / 3600, abs=1e-4)
    assert got["lost_gpu_hours"] == pytest.approx(600 / 3600)
    assert [j["job"] for j in got["lost_jobs"]] == [preempted.pk]
    assert "Lost:       0.17 GPU-hours to preemption (charged to nobody)" in (
        output.usage_report(got)
    )


def test_the_admin_overview_has_a_lost_column(
    client: Client, preempted: Job, django_user_model: Any
) -> None:
    staff = django_user_model.objects.create_user("root", is_staff=True)
    with time_machine.travel(at(T0 + 2000), tick=False):
        client.force_login(staff)
        response = client.get("/admin/overview/")
    assert response.status_code == 200
    [vision] = [u for u, _ in response.context["usage"] if u.name == "vision"]
    assert vision.hours == pytest.approx(2400 / 3600)
    assert vision.lost_hours == pytest.approx(600 / 3600)
    assert response.context["lost_hours"] == pytest.approx(600 / 3600)
    assert '<td class="num" data-field="lost">0.2</td>' in response.content.decode()


def test_the_job_page_says_what_was_lost_and_not_charged(
    client: Client, alice: User, preempted: Job
) -> None:
    client.force_login(alice)
    html = client.get(f"/jobs/{preempted.pk}/").content.decode()
    assert "0.67 GPU-hours (ended attempts)" in html
    assert "0.17 GPU-hours lost to preemption, charged to nobody" in html
    assert "resumed 1 time, 5 min of work lost" in html
