"""The console's nodes and GPUs write through the services: a node added in the
console is registered by ``services.create_node`` (its name checked as the
command's, its token stored hashed and shown once), and a GPU's slots, which
change what the scheduler may place, are set by ``services.set_gpu_slots``:
locked, checked (from 1 to the maximum, never below the slots running jobs
hold, named), recorded in the GPU's history under the admin's name, logged, and
followed by a pass on the real broker."""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any, cast

import pytest
from celery import current_app
from django.contrib import admin
from django.contrib.admin.models import ADDITION, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.test import Client, RequestFactory
from django.urls import reverse

from scheduler import pass_requests, policy, services, tasks
from scheduler.models import Gpu, Job, Node
from scheduler.services.nodes import max_gpu_slots
from tests.factories import JobFactory, shared_start, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


def staff_with(user: User, *codenames: str) -> Client:
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def page_data(client: Client, url: str) -> dict[str, Any]:
    """What the add / change page's form posts back as shown: its editable
    fields, and each inline's management form and forms."""
    page = client.get(url)
    assert page.status_code == 200
    forms = [page.context["adminform"].form]
    data: dict[str, Any] = {}
    for inline in page.context["inline_admin_formsets"]:
        forms.append(inline.formset.management_form)
        forms.extend(inline.formset.forms)
    for form in forms:
        for name in form.fields:
            value = form[name].value()
            key = form.add_prefix(name)
            if isinstance(value, bool):
                if value:
                    data[key] = "on"
            else:
                data[key] = "" if value is None else value
    return data


def flash(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def history(obj: Node | Gpu) -> list[tuple[int, str]]:
    return [
        (e.user_id, e.get_change_message())
        for e in LogEntry.objects.filter(
            content_type__model=type(obj)._meta.model_name, object_id=str(obj.pk)
        ).order_by("pk")
    ]


def first_gpu(node: Node) -> Gpu:
    gpu = node.gpus.order_by("index").first()
    assert gpu is not None
    return gpu


def _queue_key() -> str:
    conf = current_app.conf
    return (
        f"{conf.broker_transport_options['global_keyprefix']}{conf.task_default_queue}"
    )


@pytest.fixture
def broker() -> Any:
    """The pass tasks enqueued on the real broker (Redis) during the test."""
    client = pass_requests._redis_client()
    client.delete(_queue_key(), pass_requests._queued_key())

    def passes() -> int:
        raw = cast("list[bytes]", client.lrange(_queue_key(), 0, -1))
        return sum(
            json.loads(m)["headers"]["task"] == tasks.schedule_pass.name for m in raw
        )

    yield passes
    client.delete(_queue_key(), pass_requests._queued_key())


# ------------------------------------------------------------------ add a node


def test_a_node_added_in_the_console_is_registered_by_the_service(
    admin_user: User,
) -> None:
    client = staff_with(admin_user, "view_node", "add_node", "change_node")
    url = reverse("admin:scheduler_node_add")
    data = page_data(client, url)

    response = client.post(url, {**data, "name": " gpu-07 "})

    assert response.status_code == 302
    node = Node.objects.get()
    assert node.name == "gpu-07"
    (message,) = [m for m in flash(response) if "token" in m]
    token = re.fullmatch(
        r"Node gpu-07 registered\. Its agent token \(shown once\): (\S+)", message
    )
    assert token is not None
    assert services.authenticate_node(token[1]) == node
    assert token[1] not in node.token_hash
    entry = LogEntry.objects.get(object_id=str(node.pk))
    assert (entry.user, entry.action_flag) == (admin_user, ADDITION)


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("gpu 07", "Use 1-63 letters, digits, dots, dashes or underscores."),
        ("-gpu", "Use 1-63 letters, digits, dots, dashes or underscores."),
        ("node-a", "Node with this Name already exists."),
    ],
)
def test_a_node_name_the_service_refuses_is_refused_in_the_console(
    admin_user: User, cluster: list[Node], name: str, error: str
) -> None:
    client = staff_with(admin_user, "view_node", "add_node")
    url = reverse("admin:scheduler_node_add")
    data = page_data(client, url)
    before = set(Node.objects.values_list("name", "token_hash"))

    response = client.post(url, {**data, "name": name})

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["name"] == [error]
    assert set(Node.objects.values_list("name", "token_hash")) == before
    assert not LogEntry.objects.exists()


def test_a_gpus_slots_are_not_edited_on_its_nodes_page(
    admin_user: User, cluster: list[Node]
) -> None:
    node = cluster[1]
    gpu = first_gpu(node)
    client = staff_with(admin_user, "view_node", "change_node", "view_gpu")
    url = reverse("admin:scheduler_node_change", args=[node.pk])
    data = page_data(client, url)
    assert not [k for k in data if k.startswith("gpus-") and k.endswith("-slots")]
    body = client.get(url).content.decode()
    assert reverse("admin:scheduler_gpu_change", args=[gpu.pk]) in body

    response = client.post(
        url,
        {
            **data,
            "gpus-0-id": gpu.pk,
            "gpus-0-node": node.pk,
            "gpus-0-slots": "8",
            "gpus-TOTAL_FORMS": "1",
        },
    )

    assert response.status_code == 302
    gpu.refresh_from_db()
    assert gpu.slots == 2
    assert node.gpus.count() == 2


# ------------------------------------------------------------------ a GPU's slots


def test_slots_changed_in_the_console_go_through_the_service_and_are_recorded(
    admin_user: User,
    cluster: list[Node],
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu = first_gpu(cluster[0])
    client = staff_with(admin_user, "view_gpu", "change_gpu")
    url = reverse("admin:scheduler_gpu_change", args=[gpu.pk])

    with caplog.at_level(logging.INFO, logger="scheduler.services.nodes"):
        response = client.post(url, {**page_data(client, url), "slots": "4"})

    assert response.status_code == 302
    gpu.refresh_from_db()
    assert gpu.slots == 4
    assert history(gpu) == [(admin_user.pk, "slots 2 -> 4")]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU node-a:0 now has 4 slot(s) (was 2), set by root"
    ]

    # the same value again changes nothing and records nothing
    response = client.post(url, {**page_data(client, url), "slots": "4"})
    assert response.status_code == 302
    assert history(gpu) == [(admin_user.pk, "slots 2 -> 4")]


@pytest.mark.parametrize("slots", ["0", "max+1"])
def test_slots_out_of_range_posted_to_the_console_are_refused(
    admin_user: User, cluster: list[Node], slots: str
) -> None:
    gpu = first_gpu(cluster[0])
    client = staff_with(admin_user, "view_gpu", "change_gpu")
    url = reverse("admin:scheduler_gpu_change", args=[gpu.pk])
    value = str(max_gpu_slots() + 1) if slots == "max+1" else slots

    response = client.post(url, {**page_data(client, url), "slots": value})

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["slots"] == [
        f"A GPU has from 1 to {max_gpu_slots()} slots."
    ]
    gpu.refresh_from_db()
    assert gpu.slots == 2
    assert history(gpu) == []


def test_slots_below_what_a_running_job_holds_are_refused_in_the_console(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    """An exclusive job holds every slot of its GPU: lowering them while it
    runs is refused, naming it, and nothing changes."""
    gpu = first_gpu(cluster[0])
    job = JobFactory(owner=alice, shareable=False)
    start_job(job, cluster[0], [gpu])
    client = staff_with(admin_user, "view_gpu", "change_gpu")
    url = reverse("admin:scheduler_gpu_change", args=[gpu.pk])

    response = client.post(url, {**page_data(client, url), "slots": "1"})

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["slots"] == [
        f"At least 2 while running jobs hold its slots (slot 1 by job #{job.pk});"
        " lower it once they end."
    ]
    gpu.refresh_from_db()
    assert gpu.slots == 2
    assert history(gpu) == []


def test_a_job_that_took_a_slot_after_the_forms_check_makes_the_save_refused(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    """The form checks without a lock; the service checks again under the GPU's
    lock, and the console answers 403 with its reason, nothing changed."""
    gpu = first_gpu(cluster[0])
    gpu_admin = admin.site._registry[Gpu]
    request = RequestFactory().post("/")
    request.user = admin_user
    admin_user.user_permissions.set(Permission.objects.filter(codename="change_gpu"))
    form = gpu_admin.get_form(request, gpu)({"slots": "1"}, instance=gpu)
    assert form.is_valid(), form.errors
    job = JobFactory(owner=alice, shareable=False)
    start_job(job, cluster[0], [gpu])  # holds slots 0 and 1

    with pytest.raises(PermissionDenied, match=f"slot 1 by job #{job.pk}"):
        gpu_admin.save_model(request, form.save(commit=False), form, change=True)

    gpu.refresh_from_db()
    assert (gpu.slots, history(gpu)) == (2, [])


def test_a_node_name_taken_after_the_forms_check_makes_the_add_refused(
    admin_user: User,
) -> None:
    node_admin = admin.site._registry[Node]
    request = RequestFactory().post("/")
    request.user = admin_user
    form = node_admin.get_form(request, None)({"name": "gpu-09"})
    assert form.is_valid(), form.errors
    first, _ = services.create_node("gpu-09")

    with pytest.raises(PermissionDenied, match=r"A node named .gpu-09. exists\."):
        node_admin.save_model(request, form.save(commit=False), form, change=False)

    assert list(Node.objects.values_list("pk", "token_hash")) == [
        (first.pk, first.token_hash)
    ]


# ------------------------------------------------------------------ the service


def shared_pair(alice: User, node: Node, gpu: Gpu) -> tuple[Job, Job]:
    """Two shareable jobs on ``gpu``: the first alone on slot 0, the second
    beside it on slot 1."""
    first = JobFactory(owner=alice, shareable=True)
    second = JobFactory(owner=alice, shareable=True)
    one = policy.Start.on(first.pk, node.pk, (gpu.pk,))
    assert services.start_jobs([one], share_slots=True) == 1
    both = shared_start(second, gpu.pk, node.pk, (first.pk,))
    assert services.start_jobs([both], share_slots=True) == 1
    return first, second


def test_the_service_keeps_the_slots_running_jobs_hold(
    alice: User, admin_user: User, cluster: list[Node], broker: Any
) -> None:
    """Slots 0 and 1 held of 3: it may go down to 2, not to 1 (slot 1's job is
    named); a refusal writes nothing and asks for no pass."""
    node = cluster[0]
    gpu = first_gpu(node)
    Gpu.objects.filter(pk=gpu.pk).update(slots=3)
    _, second = shared_pair(alice, node, gpu)
    admin_user.user_permissions.set(Permission.objects.filter(codename="change_gpu"))

    with pytest.raises(ValidationError) as refused:
        services.set_gpu_slots(gpu.pk, 1, by=admin_user)

    assert refused.value.message_dict == {
        "slots": [
            f"At least 2 while running jobs hold its slots (slot 1 by job"
            f" #{second.pk}); lower it once they end."
        ]
    }
    gpu.refresh_from_db()
    assert (gpu.slots, history(gpu)) == (3, [])
    assert services.set_gpu_slots(gpu.pk, 2, by=admin_user) is True
    gpu.refresh_from_db()
    assert (gpu.slots, history(gpu)) == (2, [(admin_user.pk, "slots 3 -> 2")])


def test_the_service_asks_for_one_pass_after_commit_when_the_slots_change(
    admin_user: User,
    cluster: list[Node],
    broker: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    gpu = first_gpu(cluster[0])
    admin_user.is_superuser = True
    admin_user.save()

    with django_capture_on_commit_callbacks(execute=False) as pending:
        assert services.set_gpu_slots(gpu.pk, 3, by=admin_user) is True
    assert broker() == 0  # nothing before the commit
    for callback in pending:
        callback()
    assert broker() == 1

    pass_requests._redis_client().delete(_queue_key(), pass_requests._queued_key())
    with django_capture_on_commit_callbacks(execute=True):
        assert services.set_gpu_slots(gpu.pk, 3, by=admin_user) is False
    assert broker() == 0


@pytest.mark.parametrize("slots", [0, -1, "max+1"])
def test_the_service_refuses_slots_out_of_range(
    admin_user: User, cluster: list[Node], broker: Any, slots: Any
) -> None:
    gpu = first_gpu(cluster[0])
    admin_user.is_superuser = True
    admin_user.save()
    value = max_gpu_slots() + 1 if slots == "max+1" else slots

    with pytest.raises(ValidationError, match="A GPU has from 1 to"):
        services.set_gpu_slots(gpu.pk, value, by=admin_user)

    gpu.refresh_from_db()
    assert (gpu.slots, history(gpu), broker()) == (2, [], 0)


def test_the_service_refuses_an_admin_without_change_gpu(
    admin_user: User, bob: User, cluster: list[Node]
) -> None:
    gpu = first_gpu(cluster[0])
    admin_user.user_permissions.set(Permission.objects.filter(codename="view_gpu"))

    for who in (admin_user, bob):
        with pytest.raises(PermissionDenied, match="needs change_gpu"):
            services.set_gpu_slots(gpu.pk, 3, by=who)

    gpu.refresh_from_db()
    assert (gpu.slots, history(gpu)) == (2, [])
