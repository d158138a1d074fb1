"""Hostile strings in everything a user (or a job's output, or an admin) can set,
rendered through the real pages: never as markup, and never able to end a
``<script>`` block (the JSON embedded for charts goes through ``json_script``).

Each page must also show the escaped text, so a page that drops the value
altogether cannot pass for one that escapes it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.urls import reverse

from agents import protocol
from scheduler import services
from scheduler.models import Group, Job, Membership
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

# Each breaks out of an HTML context, an attribute, or a <script> block.
TAG = "<img src=x onerror=gpulabxss(1)>"
QUOTE = '"><svg onload=gpulabxss(2)>'
SCRIPT = "</script><script>gpulabxss(3)</script>"
RAW = (TAG, QUOTE, SCRIPT)


def html_escaped(text: str) -> str:
    return (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#x27;")
    )


def json_escaped(text: str) -> str:
    """What ``json_script`` makes of it inside the JSON."""
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003C")
        .replace(">", "\\u003E")
        .replace('"', '\\"')
    )


def assert_inert(html: str, *, shows: str, json: bool = False) -> None:
    for raw in RAW:
        assert raw not in html, f"{raw!r} rendered as markup"
    assert "gpulabxss(" in html, "the hostile value is not on the page at all"
    expected = json_escaped(shows) if json else html_escaped(shows)
    assert expected in html, f"{expected!r} not on the page"


HOSTILE_GROUP = f"lab{QUOTE}"
# Usernames made through the admin are validated ([\\w.@+-]); accounts imported
# from a directory (create_user) are not.
HOSTILE_USER = f"eve{SCRIPT}"


@pytest.fixture
def eve(db: None) -> User:
    from django.contrib.auth.models import User

    user = User.objects.create_user(HOSTILE_USER, "eve@lab.example", "pw-eve")
    group = Group.objects.create(name=HOSTILE_GROUP)
    Membership.objects.create(user=user, group=group)
    return user


def run_hostile_job(user: User, group: str) -> Job:
    """Submitted through the real form, run on a node, ended with a hostile
    output and reason: name, command, env, workload, workdir, log, end reason
    and notifications all carry markup."""
    node, _ = make_node(f"xss-{user.pk}", 2)
    client = Client()
    client.force_login(user)
    response = client.post(
        reverse("portal-job-new"),
        {
            "name": f"n{TAG}",
            "command": f"echo {QUOTE}; echo '{SCRIPT}'",
            "workdir": f"/tmp/w{TAG}",
            "env": f"NOTE={SCRIPT}",
            "workload": f"wl{QUOTE}",
            "gpus": "1",
            "priority_class": "normal",
            "group": group,
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get(owner=user, name=f"n{TAG}")
    attempt = start_job(job, node)
    t0 = time.time() - 120
    services.mark_started(node.pk, started_data(attempt, t0))
    services.append_log(
        node.pk,
        protocol.JobLogData(
            attempt_id=attempt.pk, job_id=job.pk, offset=0, data=f"out {SCRIPT}\n"
        ),
    )
    services.finish_attempt(
        node.pk,
        exited_data(
            attempt, None, at=t0 + 60, reason="launch_failed", message=f"bad {TAG}"
        ),
    )
    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    return job


@pytest.fixture
def hostile_job(alice: User) -> Job:
    return run_hostile_job(alice, "vision")


def page(user: User, url: str) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200, url
    return response.content.decode()


def test_the_job_page_shows_every_field_as_text(alice: User, hostile_job: Job) -> None:
    html = page(alice, reverse("portal-job", args=[hostile_job.pk]))

    assert_inert(html, shows=f"n{TAG}")
    for shown in (QUOTE, f"/tmp/w{TAG}", f"NOTE={SCRIPT}", f"wl{QUOTE}", f"bad {TAG}"):
        assert html_escaped(shown) in html, shown
    assert html_escaped(f"out {SCRIPT}") in html  # the log tail


def test_the_htmx_fragment_escapes_too(alice: User, hostile_job: Job) -> None:
    client = Client()
    client.force_login(alice)
    html = client.get(
        reverse("portal-job", args=[hostile_job.pk]), HTTP_HX_REQUEST="true"
    ).content.decode()

    assert_inert(html, shows=f"out {SCRIPT}")


@pytest.mark.parametrize("url", ["portal-jobs", "portal-usage"], ids=lambda u: u)
def test_lists_show_the_name_as_text(alice: User, hostile_job: Job, url: str) -> None:
    assert_inert(page(alice, reverse(url)), shows=f"n{TAG}")


def test_the_queue_shows_a_waiting_jobs_name_as_text(alice: User) -> None:
    JobFactory(owner=alice, name=f"q{QUOTE}")

    assert_inert(page(alice, reverse("portal-queue")), shows=f"q{QUOTE}")


def test_the_copy_form_prefills_hostile_values_as_text(
    alice: User, hostile_job: Job
) -> None:
    html = page(alice, reverse("portal-job-new") + f"?copy={hostile_job.pk}")

    assert_inert(html, shows=f"n{TAG}")
    assert html_escaped(f"echo {QUOTE}") in html


def test_the_notifications_page_shows_the_subjects_as_text(
    alice: User, hostile_job: Job
) -> None:
    assert_inert(page(alice, reverse("notifications")), shows=f"n{TAG}")


@pytest.mark.parametrize("where", ["portal-overview", "portal-nodes", "portal-node"])
def test_the_cluster_pages_show_a_running_jobs_name_as_text(
    alice: User, where: str
) -> None:
    node, _ = make_node("grid", 1)
    job = JobFactory(owner=alice, name=f"g{SCRIPT}")
    start_job(job, node)
    url = reverse(where, args=[node.pk] if where == "portal-node" else [])

    assert_inert(page(alice, url), shows=f"g{SCRIPT}")


def test_the_usage_charts_json_cannot_end_its_script_block(eve: User) -> None:
    run_hostile_job(eve, HOSTILE_GROUP)

    html = page(eve, reverse("portal-usage"))

    # The username is a key of the chart's series (json_script) and in the page.
    assert_inert(html, shows=HOSTILE_USER, json=True)
    assert html_escaped(HOSTILE_USER) in html


def test_the_admin_overview_shows_group_names_as_text(
    eve: User, admin_user: User
) -> None:
    run_hostile_job(eve, HOSTILE_GROUP)

    assert_inert(page(admin_user, reverse("admin-overview")), shows=HOSTILE_GROUP)
