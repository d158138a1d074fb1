"""What a person is shown is what runs (issue 27): the submit form refuses what
would not run or show as given, the job page shows every field of the request
(the working directory normalised), and a bidirectional control character is
shown as a visible ``⟨U+202E⟩`` marker on pages and in notifications instead of
silently reordering the text around it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.urls import reverse

from portal.notifications import services as notifications
from portal.notifications.models import Delivery, Kind, Preference
from portal.templatetags.gpulab import visible
from scheduler import services
from scheduler.models import Job
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db

RLO = "\u202e"
MARK = '<mark class="bidi" title="invisible bidirectional control character U+202E">'


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def form_data(**overrides: str) -> dict[str, str]:
    return {
        "name": "resnet",
        "command": "python train.py",
        "workdir": "/home/alice/resnet",
        "gpus": "1",
        "time_limit": "2h",
        "priority_class": "normal",
        **overrides,
    }


def one_line(html: bytes) -> str:
    return " ".join(html.decode().split())


def test_the_visible_filter_marks_bidi_controls_and_escapes_the_rest() -> None:
    html = visible(f"<b>job{RLO}gnp.exe</b>")

    assert html == (f"&lt;b&gt;job{MARK}\u27e8U+202E\u27e9</mark>gnp.exe&lt;/b&gt;")
    assert RLO not in html
    assert visible("plain & simple") == "plain &amp; simple"


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        ({"name": f"job{RLO}gnp.exe"}, "name", "U+202E"),
        ({"workload": "res\u2066net"}, "workload", "U+2066"),
        ({"workdir": "/tmp/../../../../etc"}, "workdir", "/etc is outside"),
        ({"env": "FO O=1"}, "env", "not a valid environment variable name"),
    ],
    ids=["bidi-name", "bidi-workload", "workdir-outside", "env-name"],
)
def test_the_form_refuses_it_next_to_the_field(
    alice: User, cluster: list[Node], overrides: dict[str, str], field: str, says: str
) -> None:
    response = client_for(alice).post(reverse("portal-job-new"), form_data(**overrides))

    body = response.content.decode()
    assert response.status_code == 400
    error_at = body.index(f'id="{field}-error"')
    assert says in body[error_at : error_at + 400]
    assert not Job.objects.exists()


def test_the_job_page_shows_every_field_of_the_request(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).post(
        reverse("portal-job-new"),
        form_data(
            workdir="/tmp/x/../runs/./",
            gpu_model="NVIDIA A100-80GB",
            shareable="on",
            slowdown_cap="1.25",
            on_partner_hurt="keep",
            on_node_loss="fail",
            kill_grace="90",
            workload="resnet50",
            env="SEED=7",
        ),
    )
    assert response.status_code == 302, response.content.decode()
    job = Job.objects.get()

    page = one_line(client_for(alice).get(response.url).content)

    shown = {
        "workdir": "<code>/tmp/runs</code>",
        "gpu_model": "NVIDIA A100-80GB",
        "slowdown_cap": "at most 1.25x slower when sharing",
        "evictable": "kept running",
        "requeue_on_node_loss": "failed",
        "kill_grace_s": "SIGTERM, then SIGKILL after 1m",
        "workload": "resnet50",
    }
    for field, text in shown.items():
        assert f'data-field="{field}">{text}' in page, field
    assert "<code>SEED=7</code>" in page
    assert (job.workdir, job.kill_grace_s) == ("/tmp/runs", 90)


def test_the_job_page_shows_the_defaults_too(alice: User, cluster: list[Node]) -> None:
    job = services.submit_job(
        alice, services.JobRequest(name="j", command="true", workdir="/tmp")
    )

    page = one_line(client_for(alice).get(reverse("portal-job", args=[job.pk])).content)

    assert 'data-field="slowdown_cap">the class\'s' in page
    assert 'data-field="evictable">requeued' in page
    assert 'data-field="requeue_on_node_loss">requeued' in page
    assert 'data-field="gpu_model">any' in page
    assert 'data-field="after">no other job' in page


def test_the_job_page_shows_what_it_runs_after(
    alice: User, cluster: list[Node]
) -> None:
    first = services.submit_job(
        alice, services.JobRequest(name="a", command="true", workdir="/tmp")
    )
    second = services.submit_job(
        alice,
        services.JobRequest(
            name="b", command="true", workdir="/tmp", after=f"afterok:{first.pk}"
        ),
    )

    page = one_line(
        client_for(alice).get(reverse("portal-job", args=[second.pk])).content
    )

    assert f'afterok:<a href="/jobs/{first.pk}/">{first.pk}</a>' in page


def test_bidi_controls_are_marked_wherever_the_job_is_shown(
    alice: User, cluster: list[Node]
) -> None:
    # A name stored before names were checked, and a command (kept as given).
    job = JobFactory(
        owner=alice,
        name=f"job{RLO}gnp.exe",
        command=f"rm -rf ~ # {RLO}txt.ecnereffid",
        workdir=f"/tmp/a{RLO}b",
        env={"NOTE": f"x{RLO}y"},
        workload=f"w{RLO}",
    )
    client = client_for(alice)

    page = client.get(reverse("portal-job", args=[job.pk])).content.decode()
    listing = client.get(reverse("portal-jobs")).content.decode()

    assert RLO not in page
    assert page.count(MARK) == 5  # name, command, workdir, env value, workload
    assert RLO not in listing
    assert f"job{MARK}" in listing


def test_notifications_mark_bidi_controls_for_people(alice: User) -> None:
    Preference.objects.create(user=alice, kinds=[Kind.JOB_FAILED])
    job = JobFactory(
        owner=alice, name=f"job{RLO}gnp.exe", status=Job.Status.FAILED, exit_code=1
    )

    notifications.job_changed(job, "failed with exit code 1")

    row = Delivery.objects.get()
    assert "job\u27e8U+202E\u27e9gnp.exe" in row.subject
    assert RLO not in row.subject + row.text
    assert row.payload["name"] == job.name  # programs get it exact
