"""The admin console writes through the services: a job's request is changed
in its change form only while it waits, validated as at submission and
recorded; once it has left the queue the form refuses a POST; a job's history
and the charging ledger are read only for everyone."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from scheduler.models import Job, JobEvent, UsageRecord
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db


def change_url(job: Job) -> str:
    return reverse("admin:scheduler_job_change", args=[job.pk])


def staff_client(user: User, *codenames: str) -> Client:
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def superuser_client(user: User) -> Client:
    user.is_superuser = True
    user.save()
    client = Client()
    client.force_login(user)
    return client


def form_data(client: Client, url: str) -> dict[str, Any]:
    """What the change page's form posts back as shown: its editable fields and
    its inlines' management forms."""
    page = client.get(url)
    assert page.status_code == 200
    form = page.context["adminform"].form
    data: dict[str, Any] = {}
    for name in form.fields:
        value = form[name].value()
        if isinstance(value, bool):
            if value:
                data[name] = "on"
        else:
            data[name] = "" if value is None else value
    for inline in page.context["inline_admin_formsets"]:
        management = inline.formset.management_form
        for name in management.fields:
            data[management.add_prefix(name)] = management[name].value()
    return data


def snapshot(job: Job) -> dict[str, Any]:
    job.refresh_from_db()
    fields = [f.name for f in Job._meta.fields]
    return {f: getattr(job, f) for f in fields}


# ------------------------------------------------------------------ a job's request


def test_a_running_jobs_request_cannot_be_changed(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice, env={"A": "1"})
    start_job(job, cluster[0])
    client = staff_client(admin_user, "view_job", "change_job")
    before = snapshot(job)
    events = JobEvent.objects.filter(job=job).count()

    page = client.get(change_url(job))
    assert page.status_code == 200  # shown, read only
    assert not page.context["has_change_permission"]
    assert 'name="gpus"' not in page.content.decode()

    response = client.post(
        change_url(job),
        {"gpus": "4", "env": json.dumps({"A": "2"}), "name": job.name},
    )

    assert response.status_code == 403
    assert snapshot(job) == before
    assert JobEvent.objects.filter(job=job).count() == events
    assert not LogEntry.objects.filter(object_id=str(job.pk)).exists()


def test_a_waiting_jobs_request_is_changed_through_the_service(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice, gpus=1, time_limit_s=3600)
    client = staff_client(admin_user, "view_job", "change_job")
    data = form_data(client, change_url(job))
    assert data["gpus"] == 1 and "status" not in data  # only the request is a field

    response = client.post(
        change_url(job), {**data, "gpus": "2", "time_limit_s": "7200"}
    )

    assert response.status_code == 302, response.context["adminform"].form.errors
    job.refresh_from_db()
    assert (job.gpus, job.time_limit_s, job.status) == (2, 7200, Job.Status.PENDING)
    event = JobEvent.objects.get(job=job)
    assert event.actor == admin_user
    assert event.message == (
        "request changed by root: gpus 1 -> 2, time_limit_s 3600 -> 7200"
    )
    logged = LogEntry.objects.get(object_id=str(job.pk))
    assert logged.user == admin_user


def test_a_waiting_jobs_request_is_validated_as_at_submission(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    """Every bad field is named at once, by the submit form's rules, and nothing
    is written."""
    job = JobFactory(owner=alice)
    client = staff_client(admin_user, "view_job", "change_job")
    data = form_data(client, change_url(job))
    before = snapshot(job)

    response = client.post(
        change_url(job),
        {
            **data,
            "gpus": "7",  # the cluster has 6
            "time_limit_s": str(30 * 24 * 3600),  # the normal class allows 7 days
            "env": json.dumps({"CUDA_VISIBLE_DEVICES": "0"}),  # set by gpulab
        },
    )

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert set(errors) == {"gpus", "time_limit_s", "env"}
    assert "The cluster has 6 GPU(s) in all." in errors["gpus"]
    assert snapshot(job) == before
    assert not JobEvent.objects.filter(job=job).exists()


def test_fields_outside_the_request_are_never_changed_in_the_form(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice)
    client = superuser_client(admin_user)
    data = form_data(client, change_url(job))

    response = client.post(
        change_url(job),
        {**data, "status": "running", "queue_order": "1", "owner": admin_user.pk},
    )

    assert response.status_code == 302
    job.refresh_from_db()
    assert (job.status, job.queue_order, job.owner) == (
        Job.Status.PENDING,
        None,
        alice,
    )


# ------------------------------------------------------------------ records


def usage_record(job: Job, node: Node) -> UsageRecord:
    attempt = start_job(job, node)
    now = timezone.now()
    return UsageRecord.objects.create(
        attempt=attempt,
        gpu=node.gpus.order_by("index").first(),
        user=job.owner,
        group=job.group,
        started_at=now - timedelta(hours=1),
        ended_at=now,
        share=1.0,
        gpu_seconds=3600.0,
    )


@pytest.mark.parametrize("model", ["jobevent", "usagerecord"])
def test_events_and_usage_are_read_only_even_for_a_superuser(
    alice: User, admin_user: User, cluster: list[Node], model: str
) -> None:
    job = JobFactory(owner=alice)
    event = JobEvent.objects.create(job=job, source="user", message="submitted")
    record = usage_record(job, cluster[0])
    row: Any = event if model == "jobevent" else record
    events = JobEvent.objects.filter(job=job).count()
    client = superuser_client(admin_user)
    name = f"admin:scheduler_{model}"

    assert client.get(reverse(f"{name}_change", args=[row.pk])).status_code == 200
    changed = client.post(
        reverse(f"{name}_change", args=[row.pk]),
        {"message": "rewritten", "gpu_seconds": "1", "share": "0.1"},
    )
    deleted = client.post(reverse(f"{name}_delete", args=[row.pk]), {"post": "yes"})
    added = client.post(reverse(f"{name}_add"), {"message": "forged"})

    assert (changed.status_code, deleted.status_code, added.status_code) == (
        403,
        403,
        403,
    )
    event.refresh_from_db()
    record.refresh_from_db()
    assert event.message == "submitted"
    assert (record.gpu_seconds, record.share) == (3600.0, 1.0)
    assert JobEvent.objects.filter(job=job).count() == events
    assert UsageRecord.objects.count() == 1


def test_the_service_refuses_a_job_that_left_the_queue_and_a_user_without_change_job(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    """What the form relies on when a job starts between the page and the POST."""
    from django.core.exceptions import PermissionDenied

    from scheduler import services

    job = JobFactory(owner=alice)
    with pytest.raises(PermissionDenied):
        services.change_job_request(job.pk, {"gpus": 2}, by=alice)
    start_job(job, cluster[0])
    admin_user.user_permissions.set(Permission.objects.filter(codename="change_job"))
    with pytest.raises(services.JobStateError, match="only a waiting job's request"):
        services.change_job_request(job.pk, {"gpus": 2}, by=admin_user)
    with pytest.raises(ValueError, match="Not a request field: status"):
        services.validate_request_change(job, {"status": "pending"})
    job.refresh_from_db()
    assert (job.gpus, job.status) == (1, Job.Status.STARTING)


def test_a_gpu_keeps_what_its_agent_reported_and_takes_the_admins_slots(
    admin_user: User, cluster: list[Node]
) -> None:
    gpu = cluster[0].gpus.order_by("index").first()
    assert gpu is not None
    client = superuser_client(admin_user)
    url = reverse("admin:scheduler_gpu_change", args=[gpu.pk])
    data = form_data(client, url)
    assert set(data) == {"slots"}

    response = client.post(
        url, {"slots": "2", "present": "", "memory_total_mib": "1", "mig_enabled": "on"}
    )

    assert response.status_code == 302
    gpu.refresh_from_db()
    assert (gpu.slots, gpu.present, gpu.memory_total_mib, gpu.mig_enabled) == (
        2,
        True,
        81920,
        False,
    )
    assert client.post(reverse("admin:scheduler_gpu_add"), {}).status_code == 403
