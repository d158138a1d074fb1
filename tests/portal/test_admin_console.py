"""The admin console: only staff get in; every job and node action checks its own
permission and reports per object; nodes show their live state; groups their
leaders; users their primary group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from scheduler.models import Attempt, Group, Job, Membership, Node, Profile
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.http import HttpResponse

    from tests.capture import AgentFrames

pytestmark = pytest.mark.django_db

JOBS = reverse("admin:scheduler_job_changelist")
NODES = reverse("admin:scheduler_node_changelist")


def staff_with(user: User, *codenames: str) -> Client:
    """A client logged in as ``user`` (staff) holding only these permissions."""
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def act(client: Client, url: str, action: str, *pks: int, **extra: str) -> HttpResponse:
    return client.post(
        url, {"action": action, "_selected_action": [str(p) for p in pks], **extra}
    )


def flash(response: HttpResponse) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


# ------------------------------------------------------------------ who gets in


def admin_urls() -> list[str]:
    """Every page of the console: the index, each app's index, each model's list
    and add pages, a change, history and delete page of a row of each model
    that has one, the overview."""
    urls = [reverse("admin:index"), reverse("admin-overview")]
    apps = set()
    for model in admin.site._registry:
        meta = model._meta
        apps.add(meta.app_label)
        name = f"admin:{meta.app_label}_{meta.model_name}"
        urls += [reverse(f"{name}_changelist"), reverse(f"{name}_add")]
        row = model._default_manager.order_by("pk").first()
        if row is not None:
            urls += [
                reverse(f"{name}_{page}", args=[row.pk])
                for page in ("change", "history", "delete")
            ]
    urls += [reverse("admin:app_list", args=[app]) for app in sorted(apps)]
    return urls


@pytest.mark.parametrize("persona", ["alice", "charlie", "anonymous"])
def test_only_staff_get_into_any_admin_page(
    request: pytest.FixtureRequest, persona: str, cluster: list[Node], bob: User
) -> None:
    """Signed-in users who are not staff get 403 Forbidden (issue 6), whoever's
    rows the page shows; anonymous visitors are sent to the admin's login."""
    JobFactory(owner=bob)
    client = Client()
    if persona != "anonymous":
        client.force_login(request.getfixturevalue(persona))

    urls = admin_urls()
    assert len(urls) > 40  # the rows above give every model its change pages
    for url in urls:
        response = client.get(url)
        if persona == "anonymous":
            assert response.status_code == 302, url
            assert response.url.startswith(reverse("admin:login")), url
        else:
            assert response.status_code == 403, url


def test_a_non_staff_user_cannot_post_an_action(alice: User) -> None:
    job = JobFactory(owner=alice)
    client = Client()
    client.force_login(alice)

    response = act(client, JOBS, "hold_jobs", job.pk)

    job.refresh_from_db()
    assert response.status_code == 403
    assert job.status == Job.Status.PENDING


def test_staff_still_get_every_admin_page(
    admin_user: User, cluster: list[Node], bob: User
) -> None:
    JobFactory(owner=bob)
    admin_user.is_superuser = True
    admin_user.save()
    client = Client()
    client.force_login(admin_user)

    # (add and delete pages are refused by models that are never added or
    # deleted there, such as jobs: their ModelAdmin's rule, not the site's)
    pages = [u for u in admin_urls() if not u.endswith(("/add/", "/delete/"))]
    for url in pages:
        assert client.get(url).status_code == 200, url


# Every scheduler model the console manages (the rest are written only by the
# agents' reports and the metrics pipeline, and are not in the console).
CONSOLE_MODELS = [
    "allocation",
    "attempt",
    "gpu",
    "group",
    "interferencepair",
    "job",
    "jobevent",
    "joblogchunk",
    "membership",
    "node",
    "profile",
    "progresssample",
    "usagerecord",
]


def test_the_console_index_lists_every_model(admin_user: User) -> None:
    """The registrations are found by the admin's autodiscovery: the index links
    each scheduler model's list, and the users' list is gpulab's own (with the
    primary group column)."""
    admin_user.is_superuser = True
    admin_user.save()
    client = Client()
    client.force_login(admin_user)

    body = client.get(reverse("admin:index")).content.decode()

    for name in CONSOLE_MODELS:
        assert reverse(f"admin:scheduler_{name}_changelist") in body, name
    users = client.get(reverse("admin:auth_user_changelist")).content.decode()
    assert "primary group" in users


# ------------------------------------------------------------------ job actions

# action, the permission it needs, the state it starts from, the state it leads to
JOB_ACTIONS = [
    ("cancel_jobs", "cancel_any_job", Job.Status.PENDING, Job.Status.CANCELLED),
    ("hold_jobs", "hold_job", Job.Status.PENDING, Job.Status.HELD),
    ("release_jobs", "hold_job", Job.Status.HELD, Job.Status.PENDING),
]


@pytest.mark.parametrize(("action", "perm", "before", "after"), JOB_ACTIONS)
def test_each_job_action_needs_its_permission(
    alice: User, admin_user: User, action: str, perm: str, before: str, after: str
) -> None:
    job = JobFactory(owner=alice, status=before)
    others = [p for _, p, _, _ in JOB_ACTIONS if p != perm]
    client = staff_with(admin_user, "view_job", "change_job", *others)

    listed = client.get(JOBS).context["action_form"].fields["action"].choices
    response = act(client, JOBS, action, job.pk)

    job.refresh_from_db()
    assert action not in [name for name, _ in listed]
    assert job.status == before
    assert flash(response) == ["No action selected."]


@pytest.mark.parametrize(("action", "perm", "before", "after"), JOB_ACTIONS)
def test_each_job_action_works_with_its_permission(
    alice: User, admin_user: User, action: str, perm: str, before: str, after: str
) -> None:
    job = JobFactory(owner=alice, status=before)
    client = staff_with(admin_user, "view_job", perm)

    response = act(client, JOBS, action, job.pk)

    job.refresh_from_db()
    assert response.status_code == 302
    assert job.status == after
    assert job.events.order_by("-id")[0].actor == admin_user


def test_hold_reports_each_job(alice: User, admin_user: User) -> None:
    pending = [JobFactory(owner=alice), JobFactory(owner=alice)]
    running = JobFactory(owner=alice, status=Job.Status.RUNNING)
    client = staff_with(admin_user, "view_job", "hold_job")

    response = act(client, JOBS, "hold_jobs", *(j.pk for j in [*pending, running]))

    assert flash(response) == [
        f"2 held, 1 skipped: Job #{running.pk} is running; only a pending job can"
        " be held."
    ]
    assert [j.status for j in Job.objects.filter(pk__in=[p.pk for p in pending])] == [
        Job.Status.HELD,
        Job.Status.HELD,
    ]


def test_requeue_needs_its_permission_and_stops_the_job(
    alice: User,
    admin_user: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    job = JobFactory(owner=alice)
    attempt = start_job(job, cluster[0])
    without = staff_with(admin_user, "view_job", "hold_job")

    with django_capture_on_commit_callbacks(execute=True):
        act(without, JOBS, "requeue_jobs", job.pk)
    attempt.refresh_from_db()
    assert attempt.kill_reason == ""
    assert sent.count() == 0

    client = staff_with(admin_user, "view_job", "requeue_job")
    with django_capture_on_commit_callbacks(execute=True):
        response = act(client, JOBS, "requeue_jobs", job.pk)

    attempt.refresh_from_db()
    assert flash(response) == ["1 requeued"]
    assert attempt.kill_reason == "requeued"
    [(node_id, kill)] = sent.calls()
    assert (node_id, kill["type"]) == (cluster[0].pk, "job.kill")
    assert (kill["data"]["attempt_id"], kill["data"]["reason"]) == (
        attempt.pk,
        "requeued",
    )


def test_requeue_skips_an_ended_job_with_the_reason(
    alice: User, admin_user: User
) -> None:
    job = JobFactory(owner=alice, status=Job.Status.COMPLETED)
    client = staff_with(admin_user, "view_job", "requeue_job")

    response = act(client, JOBS, "requeue_jobs", job.pk)

    assert flash(response) == [
        f"0 requeued, 1 skipped: Job #{job.pk} has ended (completed); an ended job"
        " is not requeued (resubmit a copy instead)."
    ]


def test_change_priority_asks_for_the_class_then_applies_it(
    alice: User, admin_user: User
) -> None:
    waiting = JobFactory(owner=alice)
    running = JobFactory(owner=alice, status=Job.Status.RUNNING)
    client = staff_with(admin_user, "view_job", "change_job_priority")

    page = act(client, JOBS, "change_priority", waiting.pk, running.pk)
    body = page.content.decode()
    assert page.status_code == 200
    assert "New priority class" in body
    assert f'name="_selected_action" value="{waiting.pk}"' in body
    assert waiting.priority_class == "normal"

    response = act(
        client,
        JOBS,
        "change_priority",
        waiting.pk,
        running.pk,
        apply="1",
        priority_class="best-effort",
    )

    waiting.refresh_from_db()
    running.refresh_from_db()
    assert waiting.priority_class == "best-effort"
    assert running.priority_class == "normal"
    assert flash(response) == [
        f"1 moved to class best-effort, 1 skipped: Job #{running.pk} is running;"
        " only a pending or held job can change its priority class."
    ]


def test_change_priority_refuses_an_unknown_class_on_its_form(
    alice: User, admin_user: User
) -> None:
    job = JobFactory(owner=alice)
    client = staff_with(admin_user, "view_job", "change_job_priority")

    response = act(
        client, JOBS, "change_priority", job.pk, apply="1", priority_class="urgent"
    )

    job.refresh_from_db()
    assert response.status_code == 200
    assert "Select a valid choice. urgent is not one of" in response.content.decode()
    assert job.priority_class == "normal"


def test_change_priority_needs_its_permission(alice: User, admin_user: User) -> None:
    job = JobFactory(owner=alice)
    client = staff_with(admin_user, "view_job", "hold_job")

    act(client, JOBS, "change_priority", job.pk, apply="1", priority_class="high")

    job.refresh_from_db()
    assert job.priority_class == "normal"


def test_the_job_list_shows_node_and_why_a_job_waits(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    running = JobFactory(owner=alice, name="job-on-a-node")
    start_job(running, cluster[0])
    JobFactory(owner=alice, name="job-in-queue", pending_message="behind 3 jobs")
    client = staff_with(admin_user, "view_job")

    body = client.get(JOBS, {"q": "queue"}).content.decode()
    assert "behind 3 jobs" in body
    assert "job-on-a-node" not in body
    body = client.get(JOBS, {"status__exact": "starting"}).content.decode()
    assert '<td class="field-node">node-a</td>' in body
    assert "job-in-queue" not in body


def test_jobs_are_neither_added_nor_deleted_in_the_console(
    alice: User, admin_user: User
) -> None:
    job = JobFactory(owner=alice)
    client = Client()
    client.force_login(admin_user)
    admin_user.is_superuser = True
    admin_user.save()

    add = client.get(reverse("admin:scheduler_job_add"))
    delete = client.post(reverse("admin:scheduler_job_delete", args=[job.pk]))

    assert add.status_code == 403
    assert delete.status_code == 403
    assert Job.objects.filter(pk=job.pk).exists()


# ------------------------------------------------------------------ node actions

NODE_ACTIONS = [
    ("drain", (False, False), (True, False)),
    ("maintenance", (False, False), (False, True)),
    ("resume", (True, True), (False, False)),
]


@pytest.mark.parametrize(("action", "before", "after"), NODE_ACTIONS)
def test_each_node_action_needs_drain_node(
    admin_user: User,
    cluster: list[Node],
    action: str,
    before: tuple[bool, bool],
    after: tuple[bool, bool],
) -> None:
    node = cluster[0]
    Node.objects.filter(pk=node.pk).update(draining=before[0], maintenance=before[1])
    without = staff_with(admin_user, "view_node", "rotate_node_token")

    act(without, NODES, action, node.pk)
    node.refresh_from_db()
    assert (node.draining, node.maintenance) == before

    client = staff_with(admin_user, "view_node", "drain_node")
    response = act(client, NODES, action, node.pk)

    node.refresh_from_db()
    assert response.status_code == 302
    assert (node.draining, node.maintenance) == after


def test_node_actions_report_nodes_left_as_they_were(
    admin_user: User, cluster: list[Node]
) -> None:
    node_a, node_b = cluster
    Node.objects.filter(pk=node_b.pk).update(maintenance=True)
    client = staff_with(admin_user, "view_node", "drain_node")

    response = act(client, NODES, "maintenance", node_a.pk, node_b.pk)

    assert flash(response) == [
        "1 put in maintenance, 1 skipped: node-b was already in maintenance."
    ]


def test_rotate_token_needs_its_permission(
    admin_user: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    old = node.token_hash
    without = staff_with(admin_user, "view_node", "drain_node")

    act(without, NODES, "rotate_token", node.pk)
    node.refresh_from_db()
    assert node.token_hash == old

    client = staff_with(admin_user, "view_node", "rotate_node_token")
    response = act(client, NODES, "rotate_token", node.pk)

    node.refresh_from_db()
    assert node.token_hash != old
    [message] = flash(response)
    token = message.rsplit(": ", 1)[1]
    assert node.check_token(token)


def test_the_node_list_shows_live_state(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    node_a, node_b = cluster
    start_job(JobFactory(owner=alice, gpus=2), node_a)
    start_job(JobFactory(owner=alice), node_a)
    Node.objects.filter(pk=node_b.pk).update(
        maintenance=True, status=Node.Status.LOST, connected=False
    )
    client = staff_with(admin_user, "view_node")

    response = client.get(NODES)

    rows = {
        row.name: row
        for row in response.context["cl"].result_list  # the annotated nodes
    }
    assert (rows["node-a"].n_busy, rows["node-a"].n_gpus) == (3, 4)
    assert rows["node-a"].n_running == 2
    assert (rows["node-b"].n_busy, rows["node-b"].n_gpus) == (0, 2)
    body = response.content.decode()
    assert "3 / 4" in body
    assert '<span class="node-state maintenance">maintenance</span>' in body
    assert '<span class="node-state lost">lost</span>' in body


# ------------------------------------------------------------------ groups, users


def test_groups_show_members_and_leaders_and_edit_the_leader_flag(
    alice: User, bob: User, admin_user: User, groups: dict[str, Group]
) -> None:
    vision = groups["vision"]
    Membership.objects.filter(user=alice, group=vision).update(is_leader=True)
    client = staff_with(
        admin_user, "view_group", "change_group", "view_membership", "change_membership"
    )

    listing = client.get(reverse("admin:scheduler_group_changelist"))
    change = client.get(reverse("admin:scheduler_group_change", args=[vision.pk]))

    row = next(g for g in listing.context["cl"].result_list if g.name == "vision")
    assert row.member_count == 3  # alice, bob, root
    assert "alice" in listing.content.decode()
    assert 'name="membership_set-0-is_leader"' in change.content.decode()


def test_the_groups_list_names_the_members_in_one_query_for_the_page(
    alice: User, bob: User, admin_user: User, groups: dict[str, Group]
) -> None:
    """The members column shows usernames (the first ten, then how many more),
    never the many-to-many manager's text, and the page's query count does not
    grow with the groups or their members."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.conftest import _user

    nlp = groups["nlp"]
    client = staff_with(admin_user, "view_group")
    url = reverse("admin:scheduler_group_changelist")
    with CaptureQueriesContext(connection) as few:
        client.get(url)
    for i in range(12):
        _user(f"student{i:02d}", nlp)
    Group.objects.create(name="robotics")

    with CaptureQueriesContext(connection) as many:
        body = client.get(url).content.decode()

    assert "auth.User.None" not in body
    assert 'class="field-member_names">alice, bob, root<' in body
    first_ten = ", ".join(f"student{i:02d}" for i in range(10))
    assert f'class="field-member_names">{first_ten} and 2 more<' in body
    assert 'class="field-member_names">\u2013<' in body  # robotics has none
    assert len(many) == len(few)


def test_users_show_their_primary_group(
    alice: User, admin_user: User, groups: dict[str, Group]
) -> None:
    Profile.objects.update_or_create(
        user=alice, defaults={"primary_group": groups["vision"]}
    )
    client = staff_with(admin_user, "view_user")

    body = client.get(reverse("admin:auth_user_changelist")).content.decode()

    assert 'class="field-primary_group">vision<' in body


def test_no_attempt_is_made_for_a_held_job_by_the_admin_actions(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice)
    client = staff_with(admin_user, "view_job", "hold_job")
    act(client, JOBS, "hold_jobs", job.pk)

    from scheduler import pass_runner

    pass_runner.run_one_pass()

    assert not Attempt.objects.filter(job=job).exists()
