"""Submitting an interactive job (services.submit_job with ``interactive_request``):
the product writes its command and class, gives it a secret token, holds each
user to GPULAB_INTERACTIVE_MAX_PER_USER unfinished ones, and keeps batch jobs
out of the interactive class and interactive ones in it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.core.exceptions import ValidationError

from scheduler import services
from scheduler.models import Job
from scheduler.services import JobRequest, interactive_request

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from pytest_django.fixtures import SettingsWrapper  # type: ignore[attr-defined]

pytestmark = pytest.mark.django_db


def test_a_jupyter_job_gets_the_class_command_limit_and_a_token(
    alice: User, cluster: list[Any], settings: SettingsWrapper
) -> None:
    settings.GPULAB_INTERACTIVE_MAX_PER_USER = 2
    job = services.submit_job(alice, interactive_request("jupyter", gpus=2))

    job.refresh_from_db()
    assert (job.interactive, job.priority_class, job.gpus) == (
        "jupyter",
        "interactive",
        2,
    )
    assert job.name == "JupyterLab"
    assert job.command == "jupyter lab"
    assert job.time_limit_s == 2 * 3600  # the class's default
    assert len(job.interactive_token) >= 40
    other = services.submit_job(alice, interactive_request("shell"))
    assert other.interactive_token != job.interactive_token
    assert other.command == "exec sleep infinity"


def test_the_per_user_cap_names_the_job_the_user_has(
    alice: User, bob: User, cluster: list[Any], settings: SettingsWrapper
) -> None:
    settings.GPULAB_INTERACTIVE_MAX_PER_USER = 1
    first = services.submit_job(alice, interactive_request("jupyter"))

    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, interactive_request("shell"))
    said = " ".join(caught.value.message_dict["interactive"])
    assert f"#{first.pk}" in said and "GPULAB_INTERACTIVE_MAX_PER_USER" in said
    assert Job.objects.filter(owner=alice).count() == 1
    # Another user has their own; batch jobs do not count.
    services.submit_job(bob, interactive_request("jupyter"))
    services.submit_job(alice, JobRequest(name="b", command="true", workdir="/tmp"))

    # Once it ends, the user may start another.
    Job.objects.filter(pk=first.pk).update(status=Job.Status.CANCELLED)
    services.submit_job(alice, interactive_request("jupyter"))


def test_the_time_limit_is_bounded_by_the_interactive_class(
    alice: User, cluster: list[Any]
) -> None:
    with pytest.raises(ValidationError) as caught:
        services.submit_job(
            alice, interactive_request("jupyter", time_limit_s=13 * 3600)
        )
    assert "12 h" in " ".join(caught.value.message_dict["time_limit_s"])
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("req", "field", "says"),
    [
        pytest.param(
            JobRequest(name="x", command="true", priority_class="interactive"),
            "priority_class",
            "for interactive jobs",
            id="batch-in-interactive-class",
        ),
        pytest.param(
            JobRequest(
                name="x", command="true", priority_class="high", interactive="jupyter"
            ),
            "priority_class",
            "runs in the interactive class",
            id="interactive-in-batch-class",
        ),
        pytest.param(
            JobRequest(
                name="x",
                command="true",
                priority_class="interactive",
                interactive="vnc",
            ),
            "interactive",
            "'vnc'",
            id="unknown-kind",
        ),
    ],
)
def test_classes_and_kinds_must_match(
    alice: User, cluster: list[Any], req: JobRequest, field: str, says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, req)
    assert says in " ".join(caught.value.message_dict[field])
    assert not Job.objects.exists()


def test_the_console_keeps_jobs_in_their_kind_of_class(
    alice: User, admin_user: User, cluster: list[Any]
) -> None:
    batch = services.submit_job(alice, JobRequest(name="b", command="true"))
    jupyter = services.submit_job(alice, interactive_request("jupyter"))

    with pytest.raises(ValueError, match="for interactive jobs only"):
        services.set_priority_class(batch.pk, "interactive", by=admin_user)
    with pytest.raises(ValueError, match="for batch jobs only"):
        services.set_priority_class(jupyter.pk, "high", by=admin_user)
