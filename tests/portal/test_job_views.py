"""Job pages: list, detail (and its htmx live fragment), the submit form and
"resubmit a copy", for every persona."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client
from django.urls import reverse

from scheduler.models import Job
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db

XSS = "<script>alert(1)</script>"
XSS_ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


def client_for(user: User | None) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture
def alice_job(alice: User) -> Job:
    return JobFactory(owner=alice, name="alice-resnet", command="python resnet.py")


def template_names(response: Any) -> set[str]:
    return {t.name for t in response.templates}


# ------------------------------------------------------------------ anonymous


@pytest.mark.parametrize(
    "url",
    [reverse("portal-jobs"), reverse("portal-job-new"), "/jobs/1/"],
    ids=["list", "new", "detail"],
)
def test_it_sends_anonymous_users_to_login(db: None, url: str) -> None:
    response = Client().get(url)

    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))
    assert f"next={url}" in response.url


# ------------------------------------------------------------------ list


def test_it_lists_the_owners_jobs_only(
    alice: User, charlie: User, alice_job: Job
) -> None:
    JobFactory(owner=charlie, name="charlie-bert")

    response = client_for(alice).get(reverse("portal-jobs"))

    assert response.status_code == 200
    assert "alice-resnet" in response.content.decode()
    assert "charlie-bert" not in response.content.decode()


@pytest.mark.parametrize("persona", ["bob", "charlie"])
def test_it_hides_alices_jobs_from_others(
    request: pytest.FixtureRequest, alice_job: Job, persona: str
) -> None:
    response = client_for(request.getfixturevalue(persona)).get(reverse("portal-jobs"))

    assert response.status_code == 200
    assert "alice-resnet" not in response.content.decode()


def test_it_lists_every_job_for_staff(
    admin_user: User, charlie: User, alice_job: Job
) -> None:
    JobFactory(owner=charlie, name="charlie-bert")

    body = client_for(admin_user).get(reverse("portal-jobs")).content.decode()

    assert "alice-resnet" in body
    assert "charlie-bert" in body


def test_it_filters_the_list_by_status(alice: User, alice_job: Job) -> None:
    JobFactory(owner=alice, name="done-job", status=Job.Status.COMPLETED)

    body = (
        client_for(alice)
        .get(reverse("portal-jobs"), {"status": "completed"})
        .content.decode()
    )

    assert "done-job" in body
    assert "alice-resnet" not in body


def test_it_escapes_html_in_the_list(alice: User) -> None:
    JobFactory(owner=alice, name=XSS)

    body = client_for(alice).get(reverse("portal-jobs")).content.decode()

    assert XSS not in body
    assert XSS_ESCAPED in body


# ------------------------------------------------------------------ detail


def test_it_shows_the_owner_her_job(alice: User, alice_job: Job) -> None:
    response = client_for(alice).get(reverse("portal-job", args=[alice_job.pk]))

    body = response.content.decode()
    assert response.status_code == 200
    assert "alice-resnet" in body
    assert "python resnet.py" in body
    assert reverse("portal-job-cancel", args=[alice_job.pk]) in body


@pytest.mark.parametrize(
    ("plan", "limit", "predicted", "shown"),
    [
        ("prediction", 600, 1319, "plans 10m: the smaller of the limit and the"),
        ("prediction", 7200, 1319, "plans 21m 59s: the smaller of the limit and"),
        (
            "limit",
            7200,
            1319,
            "Among jobs planned for under 6h, shorter ones go first (21m 59s"
            " counts); backfill plans with the limit",
        ),
        (
            "slurm",
            7200,
            1319,
            "21m 59s, the longest of the owner's last similar"
            " runs. Backfill plans with the limit",
        ),
    ],
)
def test_it_says_what_the_scheduler_plans_with(
    settings, alice: User, plan: str, limit: int, predicted: int, shown: str
) -> None:
    if plan == "slurm":  # no run-time factor: nothing goes first by run time
        settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "name": "slurm"}
    else:
        settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "backfill_plan": plan}
    job = JobFactory(owner=alice, time_limit_s=limit, predicted_runtime_s=predicted)

    page = " ".join(client_for(alice).get(f"/jobs/{job.pk}/").content.decode().split())

    assert "predicted run time 21m 59s, the longest of the owner's" in page
    assert shown in page


@pytest.mark.parametrize("persona", ["bob", "charlie"])
def test_it_gives_others_404_on_alices_job(
    request: pytest.FixtureRequest, alice_job: Job, persona: str
) -> None:
    client = client_for(request.getfixturevalue(persona))

    response = client.get(reverse("portal-job", args=[alice_job.pk]))

    assert response.status_code == 404
    assert "alice-resnet" not in response.content.decode()


def test_it_gives_404_for_a_job_that_does_not_exist(alice: User) -> None:
    response = client_for(alice).get(reverse("portal-job", args=[999_999]))

    assert response.status_code == 404


def test_it_shows_staff_any_job(admin_user: User, alice_job: Job) -> None:
    response = client_for(admin_user).get(reverse("portal-job", args=[alice_job.pk]))

    assert response.status_code == 200
    assert "alice-resnet" in response.content.decode()


def test_it_escapes_html_on_the_detail_page(alice: User) -> None:
    job = JobFactory(owner=alice, name=XSS, command=f"echo '{XSS}'")

    body = client_for(alice).get(reverse("portal-job", args=[job.pk])).content.decode()

    assert XSS not in body
    assert XSS_ESCAPED in body


def test_it_returns_only_the_live_fragment_to_htmx(alice: User, alice_job: Job) -> None:
    url = reverse("portal-job", args=[alice_job.pk])

    response = client_for(alice).get(url, headers={"HX-Request": "true"})

    body = response.content.decode()
    assert response.status_code == 200
    assert "portal/partials/_job_live.html" in template_names(response)
    assert "portal/job_detail.html" not in template_names(response)
    assert 'data-testid="job-status"' in body
    # its head comes along: the actions it offers change with its state
    assert f'action="/jobs/{alice_job.pk}/hold/"' in body
    assert "<h2>Request</h2>" not in body  # what never changes stays out
    assert "<html" not in body


def test_it_returns_404_to_htmx_polls_from_others(
    charlie: User, alice_job: Job
) -> None:
    url = reverse("portal-job", args=[alice_job.pk])

    response = client_for(charlie).get(url, headers={"HX-Request": "true"})

    assert response.status_code == 404


# ------------------------------------------------------------------ submit


def form_data(**overrides: str) -> dict[str, str]:
    data = {
        "name": "resnet",
        "command": "python train.py --epochs 10",
        "workdir": "/home/alice/resnet",
        "gpus": "1",
        "gpu_memory": "",
        "time_limit": "2h",
        "priority_class": "normal",
        "group": "",
        "workload": "",
        "env": "",
    }
    data.update(overrides)
    return data


def test_it_shows_the_submit_form(alice: User, cluster: list[Node]) -> None:
    response = client_for(alice).get(reverse("portal-job-new"))

    body = response.content.decode()
    assert response.status_code == 200
    assert 'name="command"' in body
    assert '<option value="vision">vision</option>' in body
    assert '<option value="nlp">' not in body  # not alice's group


def test_it_stores_a_good_submission_and_redirects_to_the_job(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).post(
        reverse("portal-job-new"),
        form_data(gpu_memory="40G", env="SEED=1\n# comment\nLR=0.1"),
    )

    job = Job.objects.get()
    assert response.status_code == 302
    assert response.url == reverse("portal-job", args=[job.pk])
    assert job.owner == alice
    assert job.status == Job.Status.PENDING
    assert job.time_limit_s == 7200
    assert job.gpu_memory_mib == 40 * 1024
    assert job.env == {"SEED": "1", "LR": "0.1"}


def test_it_stores_the_sharing_terms_asked_for(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).post(
        reverse("portal-job-new"),
        form_data(shareable="on", slowdown_cap="1.25", on_partner_hurt="keep"),
    )

    job = Job.objects.get()
    assert response.status_code == 302
    assert (job.shareable, job.slowdown_cap, job.evictable) == (True, 1.25, False)
    page = " ".join(client_for(alice).get(response.url).content.decode().split())
    assert "(may share)" in page
    assert "<dt>Slowdown cap</dt>" in page
    assert "at most 1.25x slower when sharing" in page
    assert 'data-field="evictable">kept running' in page


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        ({"gpus": "7"}, "gpus", "The cluster has 6 GPU(s) in all."),
        ({"gpus": "0"}, "gpus", "Ensure this value is greater than or equal to 1."),
        ({"time_limit": "soon"}, "time_limit", "Write a duration like 4h"),
        ({"time_limit": "30d"}, "time_limit", "The normal class allows at most 168 h."),
        ({"gpu_memory": "lots"}, "gpu_memory", "Write an amount like 12G"),
        ({"gpu_memory": "100G"}, "gpu_memory", "the largest has 81920 MiB."),
        ({"workdir": "relative/dir"}, "workdir", "must be an absolute path."),
        ({"command": "  "}, "command", "The command is empty."),
        ({"env": "CUDA_VISIBLE_DEVICES=1"}, "env", "cannot be overridden."),
        ({"env": "JUSTAWORD"}, "env", "Line 1: write KEY=VALUE."),
        ({"priority_class": "vip"}, "priority_class", "Select a valid choice."),
        ({"group": "nlp"}, "group", "Select a valid choice."),
        ({"slowdown_cap": "1.2"}, "slowdown_cap", "only applies to a job that may"),
        (
            {"slowdown_cap": "0.5", "shareable": "on"},
            "slowdown_cap",
            "greater than or equal to 1",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)
def test_it_shows_field_errors_and_stores_nothing(
    alice: User,
    cluster: list[Node],
    overrides: dict[str, str],
    field: str,
    says: str,
) -> None:
    response = client_for(alice).post(reverse("portal-job-new"), form_data(**overrides))

    body = response.content.decode()
    assert response.status_code == 400
    assert f'<p class="error" id="{field}-error">' in body
    error_at = body.index(f'id="{field}-error"')
    assert says in body[error_at : error_at + 300]
    assert Job.objects.count() == 0


def test_it_keeps_what_was_typed_after_an_error(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).post(
        reverse("portal-job-new"), form_data(gpus="7", name="keep-me")
    )

    assert 'value="keep-me"' in response.content.decode()


def test_it_prefills_a_copy_of_a_job(alice: User, cluster: list[Node]) -> None:
    job = JobFactory(
        owner=alice,
        name="copy-me",
        command="python copy.py",
        gpus=2,
        gpu_memory_mib=20480,
        time_limit_s=5400,
        env={"SEED": "7"},
    )

    response = client_for(alice).get(reverse("portal-job-new"), {"copy": job.pk})

    form = response.context["form"]
    assert response.status_code == 200
    assert form["name"].value() == "copy-me"
    assert form["command"].value() == "python copy.py"
    assert form["gpus"].value() == 2
    assert form["gpu_memory"].value() == "20480M"
    assert form["time_limit"].value() == "1h30m"
    assert form["env"].value() == "SEED=7"
    assert 'value="copy-me"' in response.content.decode()


def test_it_does_not_prefill_a_copy_of_someone_elses_job(
    charlie: User, alice_job: Job, cluster: list[Node]
) -> None:
    response = client_for(charlie).get(
        reverse("portal-job-new"), {"copy": alice_job.pk}
    )

    assert response.status_code == 200
    assert "alice-resnet" not in response.content.decode()
    assert "python resnet.py" not in response.content.decode()
