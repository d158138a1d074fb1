"""The admin overview's figures on a small hand-built cluster history, and who
may see the page.

History (UTC; "now" is 2026-11-15 12:00), on node-a (2 GPUs, each with 2 slots)
plus node-b (1 GPU, in maintenance) and node-c (1 GPU, lost): 4 GPUs.
- job A (alice, vision) ran on node-a GPU 0 on 11-14 10:00-10:30, its processes
  at 2 % SM for its first 12 minutes (idle), then busy;
- job B (charlie, nlp) ran on GPU 0 from 10-31 23:00 to 11-01 01:00 (half of it
  in November), before the samples kept (7 days): its idle time is unknown;
- job C (alice, vision) runs on GPU 0 since 11-15 09:00, holding memory at 0 % SM
  for 6 minutes, then busy for 4, then no samples (no evidence);
- job D (charlie, nlp) ran in early October (neither this month nor in 30 days).
Jobs start and end through the services; samples are stored as the consumer
stores them, hourly rollups as the rollup task writes them, and the GPU hours are
computed by ``maintain_metrics``' ``hours.maintain``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from django.db import connection
from django.test import Client
from django.urls import reverse

from portal import overview
from portal.accounting import hours
from portal.accounting.models import GpuHourStale
from scheduler import metrics, pass_log, pass_requests, services
from scheduler.models import Gpu, GpuRollup, Group, Job, Node
from scheduler.policy import PassStats
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, start_job, started_data
from tests.portal.quotas.helpers import quota
from tests.samples import insert_samples

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Attempt

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)


def at(month: int, day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, month, day, hour, minute, tzinfo=UTC)


def run(job: Job, node: Node, start: datetime, end: datetime | None) -> Attempt:
    """Start the job at ``start`` (and end it at ``end``) through the services."""
    with time_machine.travel(start, tick=False):
        attempt = start_job(job, node)
        services.mark_started(node.pk, started_data(attempt, start.timestamp()))
    if end is not None:
        with time_machine.travel(end, tick=False):
            services.finish_attempt(
                node.pk, exited_data(attempt, 0, at=end.timestamp())
            )
    return attempt


def samples(
    gpu: Gpu, start: datetime, sms: list[float], attempt: Attempt | None
) -> None:
    """One persisted sample every 10 s from ``start``: ``attempt``'s process at
    each SM figure (holding 20 GiB), or no process at all."""
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, start)
    rows = []
    for i, sm in enumerate(sms):
        procs = (
            [{"pid": 7, "used_memory_mib": 20480, "sm_util": sm,
              "attempt_id": attempt.pk}]
            if attempt is not None
            else []
        )  # fmt: skip
        rows.append(
            (gpu.pk, start + i * timedelta(seconds=10), sm, *[None] * 9, False,
             json.dumps(procs))
        )  # fmt: skip
    insert_samples(rows)


def compute_hours(now: datetime = NOW) -> None:
    """What beat's ``maintain_metrics`` does for the GPU hours, from 10-01 on."""
    GpuHourStale.objects.all().delete()
    hours.request_recompute(at(10, 1, 0))
    with time_machine.travel(now, tick=False):
        hours.maintain(now)


def rollups(gpu: Gpu, resolution: str, start: datetime, utils: list[float]) -> None:
    step = timedelta(minutes=1 if resolution == "1m" else 60)
    GpuRollup.objects.bulk_create(
        GpuRollup(
            gpu=gpu,
            resolution=resolution,
            start=start + i * step,
            samples=6 if resolution == "1m" else 360,
            util_gpu_mean=util,
            memory_used_max=20000,
        )
        for i, util in enumerate(utils)
    )


@pytest.fixture
def history(alice: User, charlie: User) -> dict[str, Any]:
    with time_machine.travel(at(10, 1, 0), tick=False):
        node_a, _ = make_node("node-a", 2)
        node_b, _ = make_node("node-b", 1)
        node_c, _ = make_node("node-c", 1)
    Node.objects.filter(pk=node_b.pk).update(maintenance=True)
    Node.objects.filter(pk=node_c.pk).update(status=Node.Status.LOST)
    gpu0, gpu1 = node_a.gpus.order_by("index")
    assert gpu0.slots == 2  # an exclusive job holds two allocation rows
    run(JobFactory(owner=charlie), node_a, at(10, 5, 10), at(10, 5, 12))  # D
    job_a = run(JobFactory(owner=alice), node_a, at(11, 14, 10), at(11, 14, 10, 30))
    run(JobFactory(owner=charlie), node_a, at(10, 31, 23), at(11, 1, 1))  # B
    job_c = JobFactory(owner=alice)
    attempt_c = run(job_c, node_a, at(11, 15, 9), None)  # C, running
    # 11-14 hourly: GPU 0 80 % then 20 % (a third of the samples), GPU 1 0 %
    rollups(gpu0, "1h", at(11, 14, 10), [80.0])
    GpuRollup.objects.create(
        gpu=gpu0, resolution="1h", start=at(11, 14, 11), samples=120, util_gpu_mean=20
    )
    rollups(gpu1, "1h", at(11, 14, 10), [0.0])
    rollups(gpu0, "1h", at(11, 15, 9), [50.0])
    rollups(gpu0, "1h", at(10, 1, 9), [99.0])  # before the 30 days
    # job A's processes idle (2 % SM) for its first 12 minutes, then busy; the
    # GPU at 0 % for 5 minutes after it ended (not held: not counted); GPU 1 at
    # 0 % but never held
    samples(gpu0, at(11, 14, 10), [2.0] * 72 + [50.0] * 108, job_a)
    samples(gpu0, at(11, 14, 10, 30), [0.0] * 30, None)
    samples(gpu1, at(11, 14, 10), [0.0] * 60, None)
    # job C holds 20 GiB at 0 % SM for 6 minutes, then works for 4 (just under
    # 95 %: its own processes, not memory, count), then nothing is sampled
    samples(gpu0, at(11, 15, 9), [0.0] * 36 + [94.99] * 24, attempt_c)
    compute_hours()
    return {"node_a": node_a, "node_b": node_b, "node_c": node_c, "job_c": job_c}


def test_usage_per_group_this_month(history: dict[str, Any]) -> None:
    usage = overview.group_usage(overview.month_start(NOW), NOW)

    got = {
        u.name: (round(u.recorded_hours, 4), round(u.running_hours, 4)) for u in usage
    }
    # vision: A 0.5 h + C running 3 h; nlp: half of B's 2 h; D is October's
    assert got == {"vision": (0.5, 3.0), "nlp": (1.0, 0.0)}
    assert [u.name for u in usage] == ["vision", "nlp"]


def test_daily_utilisation_and_idle_hours(history: dict[str, Any]) -> None:
    with time_machine.travel(NOW, tick=False):
        days = {d.day.isoformat(): d for d in overview.daily_figures(NOW)}

    assert len(days) == 30
    assert min(days) == "2026-10-17"
    assert max(days) == "2026-11-15"
    held = {
        k: round(d.allocated_percent or 0, 4)
        for k, d in days.items()
        if d.allocated_percent
    }
    # GPU time held over 4 GPUs' time: B 1 h on each side of midnight, A 30 min,
    # C 3 h of today's 12 h
    assert held == {
        "2026-10-31": round(100 * 3600 / (4 * 86400), 4),
        "2026-11-01": round(100 * 3600 / (4 * 86400), 4),
        "2026-11-14": round(100 * 1800 / (4 * 86400), 4),
        "2026-11-15": round(100 * 10800 / (4 * 43200), 4),
    }
    assert round(days["2026-11-14"].util_percent or 0, 4) == round(
        (80 * 360 + 20 * 120 + 0 * 360) / 840, 4
    )
    assert days["2026-11-15"].util_percent == 50.0
    assert days["2026-11-13"].util_percent is None
    idle = {k: round(d.idle_hours, 4) for k, d in days.items() if d.idle_hours}
    assert idle == {"2026-11-14": 0.2, "2026-11-15": 0.1}
    # B's days were computed after their samples were gone: unknown, not zero
    unknown = [k for k, d in days.items() if d.idle_hours is None]
    assert unknown == ["2026-10-31", "2026-11-01"]
    assert days["2026-11-13"].idle_hours == 0.0


def test_nodes_needing_attention(history: dict[str, Any]) -> None:
    Node.objects.filter(pk=history["node_a"].pk).update(draining=True)

    nodes = {
        n.name: (n.status, n.mode, n.n_running)
        for n in overview.nodes_needing_attention()
    }

    assert nodes == {
        "node-a": ("up", "draining", 1),
        "node-b": ("up", "maintenance", 0),
        "node-c": ("lost", "", 0),
    }


def test_the_page_shows_the_figures(history: dict[str, Any], admin_user: User) -> None:
    client = Client()
    client.force_login(admin_user)

    with time_machine.travel(NOW, tick=False):
        response = client.get(reverse("admin-overview"))

    body = response.content.decode()
    assert response.status_code == 200
    assert "Usage per group since 1 November 2026" in body
    assert '<td class="num"><strong>3.5</strong></td>' in body  # vision
    assert '<td class="num"><strong>4.5</strong></td>' in body  # all groups
    assert body.count("no quota set") == 2
    assert "Idle GPU-hours per day: 0.3 in 30 days" in body
    assert 'data-node="node-b"' in body
    assert 'data-node="node-c"' in body
    assert 'data-node="node-a"' not in body
    series = response.context["series"]
    assert series["idle"][-2:] == [0.2, 0.1]
    assert series["days"][-1] == "2026-11-15"


def test_the_admin_index_links_the_overview(admin_user: User) -> None:
    client = Client()
    client.force_login(admin_user)

    body = client.get(reverse("admin:index")).content.decode()

    assert f'href="{reverse("admin-overview")}"' in body


@pytest.mark.parametrize("persona", ["alice", "charlie", "anonymous"])
def test_only_staff_see_the_overview(
    request: pytest.FixtureRequest, persona: str
) -> None:
    client = Client()
    if persona != "anonymous":
        client.force_login(request.getfixturevalue(persona))

    response = client.get(reverse("admin-overview"))

    if persona == "anonymous":
        assert response.status_code == 302
        assert response.url.startswith(reverse("admin:login"))
    else:  # signed in, not staff: forbidden (issue 6)
        assert response.status_code == 403


def test_an_empty_cluster_shows_an_empty_overview(admin_user: User) -> None:
    client = Client()
    client.force_login(admin_user)

    response = client.get(reverse("admin-overview"))

    body = response.content.decode()
    assert response.status_code == 200
    assert "None: every node is up and takes jobs." in body
    assert all(v is None for v in response.context["series"]["allocated"])


def test_a_groups_quota_is_shown_against_its_usage(
    history: dict[str, Any], admin_user: User
) -> None:
    quota(group=Group.objects.get(name="nlp"), gpu_hours=10, period="month",
          max_gpus=4, hard=True)  # fmt: skip
    client = Client()
    client.force_login(admin_user)

    with time_machine.travel(NOW, tick=False):
        body = client.get(reverse("admin-overview")).content.decode()

    # nlp used half of B's 2 h this month (its November part)
    assert "1.0 of 10.0 GPU-h (month, 10 %); 0 of 4 GPUs at once [hard]" in body
    assert body.count("no quota set") == 1  # vision has none


@pytest.fixture
def kept_passes() -> list[pass_log.PassRecord]:
    """Two passes kept (on the real Redis), the later one stopped early."""
    pass_requests._redis_client().delete(pass_log._recent_key(), pass_log._totals_key())
    records = [
        pass_log.PassRecord.of(
            PassStats(considered=12, started=3, preempted=1, reserved=2,
                      backfilled=1, stage_s={"ordering": 0.0042}),
            at=datetime(2026, 11, 3, 9, 15, 0, tzinfo=UTC).timestamp(),
            load_s=0.010, decide_s=0.020, apply_s=0.0123, total_s=0.0423,
        ),
        pass_log.PassRecord.of(
            PassStats(considered=40, stop_reason="backfill test budget"),
            at=datetime(2026, 11, 3, 9, 15, 5, tzinfo=UTC).timestamp(),
            load_s=0.5, decide_s=1.0, apply_s=0.25, total_s=1.75,
        ),
    ]  # fmt: skip
    for record in records:
        pass_log.keep(record)
    return records


@pytest.mark.usefixtures("kept_passes")
def test_staff_see_the_scheduling_passes(admin_user: User) -> None:
    client = Client()
    client.force_login(admin_user)

    body = client.get(reverse("admin-overview")).content.decode()

    section = body[body.index('id="passes"') : body.index('id="overview-series"')]
    assert "2 passes since 2026-11-03 09:15 UTC" in section
    assert "mean 0.896 s, slowest 1.750 s" in section
    assert "52 jobs considered, 3 started" in section
    assert '<td>backfill test budget</td><td class="num">1</td>' in section
    rows = section[section.index('id="pass-recent"') :]
    # newest first, times in ms
    assert rows.index("2026-11-03 09:15:05") < rows.index("2026-11-03 09:15:00")
    assert "1750.0" in rows and "42.3" in rows and "ordering 4.2" in rows


@pytest.mark.usefixtures("kept_passes")
@pytest.mark.parametrize("persona", ["alice", "charlie", "anonymous"])
def test_others_never_see_the_scheduling_passes(
    request: pytest.FixtureRequest, persona: str
) -> None:
    client = Client()
    if persona != "anonymous":
        client.force_login(request.getfixturevalue(persona))

    response = client.get(reverse("admin-overview"), follow=True)

    body = response.content.decode()
    assert response.status_code in {200, 403}  # the login page, or forbidden
    assert "backfill test budget" not in body
    assert "Scheduling passes" not in body


def test_the_overview_shows_when_no_pass_was_kept(admin_user: User) -> None:
    pass_requests._redis_client().delete(pass_log._recent_key(), pass_log._totals_key())
    client = Client()
    client.force_login(admin_user)

    body = client.get(reverse("admin-overview")).content.decode()

    assert "0 passes." in body
    assert "No pass recorded yet." in body
