"""The pages of interactive jobs: the Start JupyterLab form (its cap and its
errors), the job page's Open button and the command that ran."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from scheduler import services
from scheduler.models import Attempt, Job, Node

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

pytestmark = pytest.mark.django_db


def client_of(client: Client, user: User) -> Client:
    client.force_login(user)
    return client


def test_the_form_starts_a_jupyter_job_and_shows_its_page(
    client: Client, alice: User, cluster: list[Any]
) -> None:
    page = client_of(client, alice).get("/jobs/new/")
    assert 'href="/jobs/jupyter/"' in page.content.decode()
    form = client.get("/jobs/jupyter/")
    assert form.status_code == 200
    assert "at most 12 h" in form.content.decode()

    done = client.post("/jobs/jupyter/", {"gpus": "2", "time_limit_h": "1.5"})
    job = Job.objects.get(owner=alice)
    assert done.status_code == 302 and done["Location"] == f"/jobs/{job.pk}/"
    assert (job.interactive, job.gpus, job.time_limit_s) == ("jupyter", 2, 5400)
    shown = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "JupyterLab" in shown
    assert job.interactive_token not in shown
    assert "open-interactive" not in shown  # not running yet
    assert "Resubmit a copy" not in shown


def test_over_the_cap_the_form_names_the_job_the_user_has(
    client: Client, alice: User, cluster: list[Any]
) -> None:
    first = services.submit_job(alice, services.interactive_request("jupyter"))
    refused = client_of(client, alice).post("/jobs/jupyter/", {"gpus": "1"})
    assert refused.status_code == 400
    assert f"you already have #{first.pk}" in refused.content.decode()
    assert Job.objects.filter(owner=alice).count() == 1


def test_bad_sizes_are_refused_by_field(
    client: Client, alice: User, cluster: list[Any]
) -> None:
    refused = client_of(client, alice).post(
        "/jobs/jupyter/", {"gpus": "99", "time_limit_h": "13"}
    )
    text = refused.content.decode()
    assert refused.status_code == 400
    assert "GPU(s) in all" in text and "at most 12 h" in text
    assert not Job.objects.exists()


def running_jupyter(owner: User, node: Node, *, port: int | None = 8888) -> Job:
    job = services.submit_job(owner, services.interactive_request("jupyter"))
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    Attempt.objects.create(
        job=job,
        number=1,
        node=node,
        interactive_host="10.0.0.5",
        interactive_port=port,
        interactive_command="/opt/env/bin/jupyter lab --no-browser",
    )
    return job


def test_the_job_page_offers_open_to_its_owner_while_it_runs(
    client: Client, alice: User, bob: User, cluster: list[Any]
) -> None:
    job = running_jupyter(alice, cluster[0])
    page = client_of(client, alice).get(f"/jobs/{job.pk}/").content.decode()
    assert f'href="/interactive/{job.pk}/lab"' in page
    assert "/opt/env/bin/jupyter lab --no-browser" in page
    assert "10.0.0.5" not in page and "8888" not in page  # the node's port is ours
    assert job.interactive_token not in page


def test_starting_is_said_until_the_agent_reports_the_server(
    client: Client, alice: User, cluster: list[Any]
) -> None:
    job = running_jupyter(alice, cluster[0], port=None)
    page = client_of(client, alice).get(f"/jobs/{job.pk}/").content.decode()
    assert "open-interactive" not in page
    assert "JupyterLab is starting" in page


# ---------------------------------------------------------------- the API


def api_client(client: Client, user: User) -> Client:
    client.force_login(user)
    return client


def test_the_api_submits_an_interactive_job_with_the_field(
    client: Client, alice: User, cluster: list[Any]
) -> None:
    api = api_client(client, alice)
    made = api.post(
        "/api/v1/jobs/",
        {"interactive": "jupyter", "gpus": 2, "time_limit_s": 3600},
        content_type="application/json",
    )
    assert made.status_code == 201, made.content
    body = made.json()
    job = Job.objects.get(pk=body["id"])
    assert (body["interactive"], body["priority_class"]) == ("jupyter", "interactive")
    assert body["interactive_url"] == f"/interactive/{job.pk}/"
    assert body["command"] == "jupyter lab" and body["name"] == "JupyterLab"
    assert job.interactive_token not in made.content.decode()
    assert (
        job.interactive_token not in api.get(f"/api/v1/jobs/{job.pk}/").content.decode()
    )

    again = api.post(
        "/api/v1/jobs/", {"interactive": "shell"}, content_type="application/json"
    )
    assert again.status_code == 400
    assert f"#{job.pk}" in " ".join(again.json()["fields"]["interactive"])


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"command": "rm -rf ~"}, "command"),
        ({"env": {"A": "1"}}, "env"),
        ({"checkpointable": True}, "checkpointable"),
        ({"priority_class": "high"}, "priority_class"),
    ],
)
def test_the_api_refuses_what_gpulab_sets_for_an_interactive_job(
    client: Client, alice: User, cluster: list[Any], extra: dict[str, Any], field: str
) -> None:
    refused = api_client(client, alice).post(
        "/api/v1/jobs/",
        {"interactive": "jupyter", **extra},
        content_type="application/json",
    )
    assert refused.status_code == 400
    assert field in refused.json()["fields"]
    assert not Job.objects.exists()


def test_a_batch_job_still_needs_its_name_and_command_and_not_the_interactive_class(
    client: Client, alice: User, cluster: list[Any]
) -> None:
    api = api_client(client, alice)
    refused = api.post("/api/v1/jobs/", {}, content_type="application/json")
    assert refused.status_code == 400
    assert {"name", "command"} <= set(refused.json()["fields"])
    refused = api.post(
        "/api/v1/jobs/",
        {"name": "x", "command": "true", "priority_class": "interactive"},
        content_type="application/json",
    )
    assert refused.status_code == 400
    assert "priority_class" in refused.json()["fields"]
    assert not Job.objects.exists()


def test_another_user_gets_404_for_the_job_in_the_api(
    client: Client, alice: User, bob: User, cluster: list[Any]
) -> None:
    job = services.submit_job(alice, services.interactive_request("jupyter"))
    assert api_client(client, bob).get(f"/api/v1/jobs/{job.pk}/").status_code == 404


def test_the_admin_shows_no_token(
    client: Client, alice: User, admin_user: User, cluster: list[Any]
) -> None:
    job = running_jupyter(alice, cluster[0])
    admin_user.is_superuser = True
    admin_user.save()
    page = client_of(client, admin_user).get(f"/admin/scheduler/job/{job.pk}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "jupyter" in text
    assert job.interactive_token not in text
