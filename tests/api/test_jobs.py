"""The jobs API for each persona: alice owns the job, bob shares her group,
charlie is in another group, root is staff. The same services and rules as the
web UI: what alice may not see is a 404, a verb in the wrong state a 409."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from scheduler import services
from scheduler.models import Attempt, Job, JobLogChunk
from scheduler.pass_runner import run_one_pass
from tests.api.conftest import api_for
from tests.factories import JobFactory, exited_data, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db

JOB = {"name": "resnet", "command": "python train.py", "workdir": "/home/alice"}


def test_alice_submits_a_job(as_alice: Api, cluster: list[Node]) -> None:
    got = as_alice.post("/api/v1/jobs/", {**JOB, "gpus": 2, "time_limit_s": 3600})
    assert got.status_code == 201, got.json()
    body = got.json()
    assert (body["owner"], body["state"], body["gpus"]) == ("alice", "pending", 2)
    job = Job.objects.get(pk=body["id"])
    assert job.time_limit_s == 3600
    assert job.events.get().message == "submitted by alice"


def test_bad_input_names_every_field_and_stores_nothing(
    as_alice: Api, cluster: list[Node]
) -> None:
    got = as_alice.post(
        "/api/v1/jobs/",
        {**JOB, "command": "", "gpus": 99, "priority_class": "urgent", "after": "x"},
    )
    assert got.status_code == 400
    body = got.json()
    assert body["error"] == "invalid"
    assert set(body["fields"]) == {"command", "gpus", "priority_class", "after"}
    assert "6 GPU(s) in all" in body["fields"]["gpus"][0]
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"gpus": "two"}, "gpus"),
        ({"gpus": 2**40}, "gpus"),
        ({"env": {"A": 1.5}}, "env.A"),
        ({"env": ["A=1"]}, "env"),
        ({"name": "a\x00b"}, "name"),
        ({"group": "\ud800"}, "group"),
        ({"shareable": "maybe"}, "shareable"),
    ],
)
def test_bad_types_are_a_400_naming_the_field(
    as_alice: Api, cluster: list[Node], data: dict[str, Any], field: str
) -> None:
    got = as_alice.post("/api/v1/jobs/", {**JOB, **data})
    assert got.status_code == 400
    assert field in got.json()["fields"]


def test_a_wrong_type_does_not_hide_the_other_bad_fields(
    as_alice: Api, cluster: list[Node]
) -> None:
    """A field of the wrong type (the serializer's word) and fields that break the
    services' rules are named in the same answer."""
    got = as_alice.post(
        "/api/v1/jobs/",
        {**JOB, "gpus": "two", "priority_class": "urgent", "after": "x"},
    )
    assert got.status_code == 400
    fields = got.json()["fields"]
    assert set(fields) == {"gpus", "priority_class", "after"}
    assert "valid integer" in fields["gpus"][0]
    assert "urgent" in fields["priority_class"][0]
    got = as_alice.post(
        "/api/v1/arrays/", {**JOB, "shareable": "maybe", "array": "9-1", "gpus": 99}
    )
    assert got.status_code == 400
    fields = got.json()["fields"]
    assert set(fields) == {"shareable", "array", "gpus"}
    assert "ends before it starts" in fields["array"][0]
    assert not Job.objects.exists()


def test_a_body_that_is_not_json_is_refused(as_alice: Api, cluster: list[Node]) -> None:
    got = as_alice.post("/api/v1/jobs/", "name=x", content_type="text/plain")
    assert (got.status_code, got.json()["error"]) == (415, "unsupported_media_type")
    got = as_alice.post("/api/v1/jobs/", "{bad json", content_type="application/json")
    assert (got.status_code, got.json()["error"]) == (400, "parse_error")


def test_a_body_over_the_limit_is_413(
    as_alice: Api, cluster: list[Node], settings: Any
) -> None:
    settings.GPULAB_API_MAX_BODY_BYTES = 2048
    got = as_alice.post("/api/v1/jobs/", {**JOB, "command": "x" * 4000})
    assert got.status_code == 413
    assert got.json()["error"] == "too_large"
    assert not Job.objects.exists()


def test_no_token_is_401_and_a_wrong_method_405(as_alice: Api) -> None:
    from tests.api.conftest import Api as Anonymous

    got = Anonymous(None).get("/api/v1/jobs/")
    assert got.status_code == 401
    assert got["WWW-Authenticate"] == "Bearer"
    assert got.json()["error"] == "not_authenticated"
    got = Anonymous("gpl_not-a-token").get("/api/v1/jobs/")
    assert (got.status_code, got.json()["error"]) == (401, "authentication_failed")
    got = as_alice.client.delete("/api/v1/jobs/", headers=as_alice.headers)
    assert (got.status_code, got.json()["error"]) == (405, "method_not_allowed")
    got = as_alice.get("/api/v1/nowhere/")
    assert (got.status_code, got.json()["error"]) == (404, "not_found")


# ------------------------------------------------------------------ personas


@pytest.fixture
def job(alice: User) -> Job:
    return JobFactory(owner=alice)


def test_each_persona_sees_what_the_web_ui_shows(
    job: Job, as_alice: Api, as_bob: Api, as_charlie: Api, as_admin: Api
) -> None:
    path = f"/api/v1/jobs/{job.pk}/"
    assert as_alice.get(path).json()["id"] == job.pk
    assert as_admin.get(path).json()["owner"] == "alice"
    for outsider in (as_bob, as_charlie):
        got = outsider.get(path)
        assert (got.status_code, got.json()["error"]) == (404, "not_found")
        assert outsider.get("/api/v1/jobs/").json()["count"] == 0
    assert [j["id"] for j in as_alice.get("/api/v1/jobs/").json()["results"]] == [
        job.pk
    ]


def test_cancel_by_persona_and_twice(
    job: Job, as_alice: Api, as_bob: Api, as_charlie: Api
) -> None:
    path = f"/api/v1/jobs/{job.pk}/cancel/"
    assert as_bob.post(path).status_code == 404
    assert as_charlie.post(path).status_code == 404
    got = as_alice.post(path)
    assert (got.status_code, got.json()["state"]) == (200, "cancelled")
    again = as_alice.post(path)
    assert again.status_code == 409
    assert again.json() == {
        "error": "wrong_state",
        "detail": f"Job #{job.pk} has already ended (cancelled).",
        "fields": {},
    }


def test_cancelling_another_users_job_needs_cancel_any_job(
    job: Job, as_admin: Api, admin_user: User
) -> None:
    from django.contrib.auth.models import Permission

    # staff see every job; without the console's cancel_any_job they may not
    # cancel one, and it keeps waiting
    got = as_admin.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    assert got.json()["detail"] == f"You may not cancel job #{job.pk}."
    job.refresh_from_db()
    assert (job.status, job.cancel_requested_at) == (Job.Status.PENDING, None)
    admin_user.user_permissions.add(Permission.objects.get(codename="cancel_any_job"))
    assert as_admin.post(f"/api/v1/jobs/{job.pk}/cancel/").json()["state"] == (
        "cancelled"
    )


def test_a_leader_sees_the_groups_jobs_but_cannot_cancel_them(
    job: Job, bob: User, as_alice: Api, cluster: list[Node]
) -> None:
    """Leaders see their group's jobs read only (issue 6): a job and an array of
    alice's are visible to bob as leader, and neither cancel changes anything."""
    from scheduler.models import Membership

    Membership.objects.filter(user=bob).update(is_leader=True)
    as_leader = api_for(bob)
    assert as_leader.get(f"/api/v1/jobs/{job.pk}/").json()["owner"] == "alice"
    got = as_leader.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    array = as_alice.post("/api/v1/arrays/", {**JOB, "array": "0-2"}).json()
    assert as_leader.get(f"/api/v1/arrays/{array['id']}/").status_code == 200
    got = as_leader.post(f"/api/v1/arrays/{array['id']}/cancel/")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    assert set(Job.objects.values_list("status", flat=True)) == {Job.Status.PENDING}
    assert not Job.objects.filter(cancel_requested_at__isnull=False).exists()


def test_hold_and_release_follow_the_model_rules(
    job: Job, as_alice: Api, as_admin: Api, admin_user: User
) -> None:
    from django.contrib.auth.models import Permission

    # staff without the console's hold_job permission may not hold alice's job
    got = as_admin.post(f"/api/v1/jobs/{job.pk}/hold/")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    admin_user.user_permissions.add(Permission.objects.get(codename="hold_job"))
    held = as_admin.post(f"/api/v1/jobs/{job.pk}/hold/")
    assert (held.status_code, held.json()["held_by"]) == (200, "root")
    # an admin's hold is released by an admin only (Job.can_be_released_by)
    got = as_alice.post(f"/api/v1/jobs/{job.pk}/release/")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    assert as_admin.post(f"/api/v1/jobs/{job.pk}/release/").json()["state"] == (
        "pending"
    )
    assert as_alice.post(f"/api/v1/jobs/{job.pk}/hold/").json()["state"] == "held"
    assert as_alice.post(f"/api/v1/jobs/{job.pk}/hold/").status_code == 409


def test_requeue_needs_the_admin_permission(
    alice: User,
    admin_user: User,
    as_alice: Api,
    as_admin: Api,
    cluster: list[Node],
) -> None:
    from django.contrib.auth.models import Permission

    job = services.submit_job(alice, services.JobRequest(**JOB))
    run_one_pass()
    for persona in (as_alice, as_admin):  # the owner, and staff without it
        got = persona.post(f"/api/v1/jobs/{job.pk}/requeue/")
        assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    admin_user.user_permissions.add(Permission.objects.get(codename="requeue_job"))
    admin = as_admin.post(f"/api/v1/jobs/{job.pk}/requeue/")
    assert admin.status_code == 200
    assert Attempt.objects.get(job=job).kill_reason == "requeued"
    assert as_admin.post(f"/api/v1/jobs/{job.pk}/requeue/").status_code == 409


# ------------------------------------------------------------------ list


def test_the_list_filters_and_pages(
    alice: User, as_alice: Api, as_admin: Api, charlie: User
) -> None:
    mine = [JobFactory(owner=alice) for _ in range(3)]
    done = JobFactory(owner=alice, status=Job.Status.COMPLETED)
    theirs = JobFactory(owner=charlie)
    got = as_alice.get("/api/v1/jobs/", state="pending", limit=2).json()
    assert got["count"] == 3
    assert [j["id"] for j in got["results"]] == [mine[2].pk, mine[1].pk]
    assert got["next"] is not None and "offset=2" in got["next"]
    rest = as_alice.get("/api/v1/jobs/", state="pending", limit=2, offset=2).json()
    assert [j["id"] for j in rest["results"]] == [mine[0].pk]
    assert as_alice.get("/api/v1/jobs/", state="completed").json()["count"] == 1
    assert as_admin.get("/api/v1/jobs/", owner="charlie").json()["results"][0][
        "id"
    ] == (theirs.pk)
    assert as_admin.get("/api/v1/jobs/", group="nlp").json()["count"] == 1
    assert done.pk in [
        j["id"]
        for j in as_alice.get("/api/v1/jobs/", state="active,completed").json()[
            "results"
        ]
    ]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"state": "sleeping"}, "state"),
        ({"limit": "0"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"offset": "-1"}, "offset"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-01-02T00:00Z", "until": "2026-01-01T00:00Z"}, "until"),
    ],
)
def test_bad_filters_are_named(
    as_alice: Api, params: dict[str, str], field: str
) -> None:
    got = as_alice.get("/api/v1/jobs/", **params)
    assert got.status_code == 400
    assert field in got.json()["fields"]


# ------------------------------------------------------------------ logs, events


def test_logs_follow_by_offset_and_tail(
    alice: User, as_alice: Api, as_bob: Api, cluster: list[Node]
) -> None:
    job = services.submit_job(alice, services.JobRequest(**JOB))
    empty = as_alice.get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert (empty["data"], empty["next_offset"], empty["complete"]) == ("", 0, False)
    run_one_pass()
    attempt = Attempt.objects.get(job=job)
    for offset, text in ((0, "épo"), (4, "ch 1\n"), (9, "epoch 2\n")):
        JobLogChunk.objects.create(
            attempt=attempt, node_id=attempt.node_id, offset=offset, data=text
        )
    path = f"/api/v1/jobs/{job.pk}/logs/"
    first = as_alice.get(path, limit=9).json()
    assert (first["data"], first["next_offset"]) == ("époch 1\n", 9)
    assert first["complete"] is False
    rest = as_alice.get(path, offset=first["next_offset"]).json()
    assert (rest["data"], rest["next_offset"]) == ("epoch 2\n", 17)
    assert as_alice.get(path, offset=17).json()["data"] == ""
    assert as_alice.get(path, tail=4).json()["data"] == "h 2\n"
    assert as_bob.get(path).status_code == 404
    services.mark_started(attempt.node_id, started_data(attempt))
    services.finish_attempt(attempt.node_id, exited_data(attempt, 0))
    assert as_alice.get(path, offset=17).json()["complete"] is True
    assert as_alice.get(path, offset=0, tail=3).status_code == 400
    assert as_alice.get(path, attempt=9).status_code == 404


def test_events_are_the_jobs_history(job: Job, as_alice: Api) -> None:
    services.cancel_job(job.pk, by=job.owner)
    events = as_alice.get(f"/api/v1/jobs/{job.pk}/events/").json()
    assert events[-1]["message"] == "cancelled by alice"
    assert (events[-1]["to_state"], events[-1]["actor"]) == ("cancelled", "alice")


# ------------------------------------------------------------------ arrays


def test_an_array_is_submitted_shown_and_cancelled(
    as_alice: Api, as_charlie: Api, cluster: list[Node]
) -> None:
    got = as_alice.post("/api/v1/arrays/", {**JOB, "array": "0-4%2"})
    assert got.status_code == 201, got.json()
    array = got.json()
    assert (array["size"], array["max_running"], array["spec"]) == (5, 2, "0-4%2")
    assert [t["index"] for t in array["tasks"]] == [0, 1, 2, 3, 4]
    assert array["counts"] == {"pending": 5}
    path = f"/api/v1/arrays/{array['id']}/"
    assert as_charlie.get(path).status_code == 404
    assert as_charlie.post(path + "cancel/").status_code == 404
    one = array["tasks"][1]["id"]
    assert as_alice.post(f"/api/v1/jobs/{one}/cancel/").status_code == 200
    cancelled = as_alice.post(path + "cancel/").json()["cancelled"]
    assert len(cancelled) == 4 and one not in cancelled
    assert as_alice.get(path).json()["counts"] == {"cancelled": 5}
    listed = as_alice.get("/api/v1/jobs/", array=array["id"]).json()
    assert listed["count"] == 5


def test_an_array_cancelled_with_a_task_running_counts_it_running_until_it_exits(
    as_alice: Api, cluster: list[Node], django_capture_on_commit_callbacks: Any
) -> None:
    got = as_alice.post("/api/v1/arrays/", {**JOB, "array": "0-5%1"})
    path = f"/api/v1/arrays/{got.json()['id']}/"
    run_one_pass()
    attempt = Attempt.objects.get(job__array_id=got.json()["id"])
    services.mark_started(attempt.node_id, started_data(attempt))

    with django_capture_on_commit_callbacks(execute=True):
        cancelled = as_alice.post(path + "cancel/").json()["cancelled"]

    assert len(cancelled) == 6
    shown = as_alice.get(path).json()
    assert shown["counts"] == {"cancelled": 5, "running": 1}
    assert [t["id"] for t in shown["tasks"] if t["state"] == "running"] == [
        attempt.job_id
    ]
    with django_capture_on_commit_callbacks(execute=True):
        services.finish_attempt(attempt.node_id, exited_data(attempt, 143))
    assert as_alice.get(path).json()["counts"] == {"cancelled": 6}
    assert as_alice.post(path + "cancel/").json()["cancelled"] == []


def test_a_bad_array_spec_is_named(as_alice: Api, cluster: list[Node]) -> None:
    got = as_alice.post("/api/v1/arrays/", {**JOB, "array": "9-1"})
    assert got.status_code == 400
    assert "ends before it starts" in got.json()["fields"]["array"][0]
    assert not Job.objects.exists()


def test_dependencies_are_shown_with_their_state(
    job: Job, as_alice: Api, cluster: list[Node]
) -> None:
    got = as_alice.post("/api/v1/jobs/", {**JOB, "after": f"afterok:{job.pk}"})
    assert got.json()["dependencies"] == [
        {"type": "afterok", "job": job.pk, "state": "pending"}
    ]
