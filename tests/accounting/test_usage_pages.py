"""The Usage page and its CSV export: who sees what (403s), the figures against the
records, running jobs live, bad ranges."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
import time_machine

from scheduler.models import Group, Membership, UsageRecord
from tests.accounting.test_charges import GIB, T0, end, join, run_alone
from tests.conftest import make_node
from tests.factories import JobFactory
from tests.portal.quotas.helpers import quota

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

    from scheduler.models import Node

pytestmark = pytest.mark.django_db

DAY = "from=2027-01-15&to=2027-01-15"  # T0's UTC day


def lead(user: User, group: str) -> None:
    Membership.objects.filter(user=user, group__name=group).update(is_leader=True)


def test_a_user_sees_their_own_usage(client: Client, alice: User, usage: None) -> None:
    client.force_login(alice)

    response = client.get(f"/usage/?{DAY}")

    assert response.status_code == 200
    report = response.context["report"]
    assert report.series == {"alice": [pytest.approx(2.0)]}
    assert report.gpu_hours == pytest.approx(2.0)
    assert [row["job"].owner for row in report.top_jobs] == [alice]
    assert response.context["groups"] == []  # leads no group: no selector
    assert b'id="usage-chart"' in response.content
    assert b'id="quota"' in response.content


def test_a_group_leader_sees_the_group_per_user(
    client: Client, alice: User, usage: None
) -> None:
    lead(alice, "vision")
    client.force_login(alice)

    response = client.get(f"/usage/?group=vision&{DAY}")

    assert response.status_code == 200
    report = response.context["report"]
    assert report.series == {
        "alice": [pytest.approx(2.0)],
        "bob": [pytest.approx(0.5)],
    }
    assert [g.name for g in response.context["groups"]] == ["vision"]


@pytest.mark.parametrize("path", ["/usage/", "/usage/csv/"])
@pytest.mark.parametrize(
    ("who", "group"),
    [
        ("bob", "vision"),  # a member, not a leader
        ("charlie", "vision"),  # another group
        ("alice", "nlp"),  # leads vision, not nlp
        ("charlie", "nosuch"),
    ],
)
def test_a_non_staff_user_gets_403_on_a_group_they_do_not_lead(
    client: Client, usage: None, alice: User, *, path: str, who: str, group: str
) -> None:
    from django.contrib.auth.models import User

    lead(alice, "vision")
    client.force_login(User.objects.get(username=who))

    response = client.get(f"{path}?group={group}&{DAY}")

    assert response.status_code == 403


def test_staff_see_any_group(client: Client, admin_user: User, usage: None) -> None:
    client.force_login(admin_user)

    response = client.get(f"/usage/?group=nlp&{DAY}")

    assert response.status_code == 200
    assert response.context["report"].series == {"charlie": [pytest.approx(1.0)]}
    assert {g.name for g in response.context["groups"]} == {"vision", "nlp"}


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("from=2027-02-01&to=2027-01-01", "starts (2027-02-01) after it ends"),
        ("from=yesterday", "Enter a valid date"),
        ("to=2027-13-01", "Enter a valid date"),
    ],
)
def test_a_bad_range_gets_a_clear_error(
    client: Client, alice: User, usage: None, *, query: str, message: str
) -> None:
    client.force_login(alice)

    page = client.get(f"/usage/?{query}")
    export = client.get(f"/usage/csv/?{query}")

    assert page.status_code == 400
    assert message in page.content.decode()
    assert export.status_code == 400
    assert message in export.content.decode()
    assert UsageRecord.objects.count() == 4  # nothing stored changed


def read_csv(response: Any) -> list[dict[str, str]]:
    body = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(body)))


def test_the_csv_export_matches_the_records(
    client: Client, alice: User, usage: None
) -> None:
    lead(alice, "vision")
    client.force_login(alice)

    response = client.get(f"/usage/csv/?group=vision&{DAY}")

    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv"
    rows = read_csv(response)
    records = UsageRecord.objects.filter(group__name="vision").select_related(
        "attempt__job", "user", "gpu__node"
    )
    expected = sorted(
        (
            str(r.attempt.job_id),
            str(r.attempt.number),
            r.user.username,
            "vision",
            f"{r.gpu.node.name}:{r.gpu.index}",
            r.started_at.isoformat(),
            r.ended_at.isoformat(),
            pytest.approx(r.gpu_seconds / 3600),
            pytest.approx(r.share),
        )
        for r in records
    )
    got = sorted(
        (
            row["job"], row["attempt"], row["user"], row["group"], row["gpu"],
            row["start"], row["end"], float(row["gpu_hours"]), float(row["share"]),
        )
        for row in rows
    )  # fmt: skip
    assert got == expected
    assert len(got) == 3  # alice's two GPUs, bob's one


def test_the_csv_export_leaves_out_records_outside_the_range(
    client: Client, alice: User, usage: None
) -> None:
    client.force_login(alice)

    response = client.get("/usage/csv/?from=2027-01-16&to=2027-01-31")

    assert read_csv(response) == []


def test_running_jobs_are_charged_live_at_their_current_share(
    client: Client, alice: User, bob: User
) -> None:
    now = datetime(2027, 6, 1, 12, 0, tzinfo=UTC)
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=20 * GIB)
    b = JobFactory(owner=bob, shareable=True, gpu_memory_mib=60 * GIB)
    first = run_alone(a, node, now.timestamp() - 3600)
    join(b, gpu, node, a, now.timestamp() - 1800)
    lead(alice, "vision")

    with time_machine.travel(now, tick=False):
        client.force_login(alice)  # a session of that time
        page = client.get("/usage/?group=vision&from=2027-06-01&to=2027-06-01")
        rows = read_csv(
            client.get("/usage/csv/?group=vision&from=2027-06-01&to=2027-06-01")
        )

    report = page.context["report"]
    # alice: 30 min alone + 30 min at 20/80; bob: 30 min at 60/80
    assert report.series == {
        "alice": [pytest.approx(0.625)],
        "bob": [pytest.approx(0.375)],
    }
    assert report.running_gpu_hours == pytest.approx(1.0)
    by_job = {row["job"]: row for row in rows}
    assert by_job[str(a.pk)]["end"] == ""
    assert float(by_job[str(a.pk)]["gpu_hours"]) == pytest.approx(0.625)
    assert float(by_job[str(b.pk)]["share"]) == pytest.approx(0.75)
    assert not UsageRecord.objects.filter(attempt=first).exists()


def test_the_job_page_shows_its_charge_and_energy(
    client: Client, alice: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice)
    attempt = run_alone(job, node, T0)
    end(node, attempt, T0 + 1800)
    UsageRecord.objects.filter(attempt=attempt).update(energy_j=3.6e6 * 0.15)
    client.force_login(alice)

    page = " ".join(client.get(f"/jobs/{job.pk}/").content.decode().split())

    assert "0.50 GPU-hours (ended attempts); energy 0.150 kWh" in page


def test_the_usage_page_shows_the_quotas_of_what_it_shows(
    client: Client, alice: User, usage: None
) -> None:
    """Alone, a user sees their own quota and their groups'; a leader looking at a
    group sees that group's, not their own."""
    own = quota(user=alice, gpu_hours=100, period="month")
    vision = quota(group=Group.objects.get(name="vision"), gpu_hours=10, period="week")
    lead(alice, "vision")
    client.force_login(alice)

    mine = client.get(f"/usage/?{DAY}")
    theirs = client.get(f"/usage/?group=vision&{DAY}")

    assert {s.quota for s in mine.context["quotas"]} == {own, vision}
    assert [s.quota for s in theirs.context["quotas"]] == [vision]
    assert b"Quotas of vision" in theirs.content
    assert f'data-testid="quota-{own.pk}"'.encode() in mine.content


def test_a_leaders_top_jobs_link_to_pages_they_may_open(
    client: Client, alice: User, bob: User, usage: None
) -> None:
    """The group's jobs are the leader's to see (read only): the links of the top
    jobs open, alice's included."""
    lead(bob, "vision")
    client.force_login(bob)
    page = client.get(f"/usage/?group=vision&{DAY}")
    jobs = [row["job"] for row in page.context["report"].top_jobs]

    assert {j.owner.username for j in jobs} == {"alice", "bob"}
    for job in jobs:
        assert client.get(f"/jobs/{job.pk}/").status_code == 200
