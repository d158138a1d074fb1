"""Nodes, queue, usage and me through the API, by persona."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission

from scheduler import services
from scheduler.models import Attempt, Job, Membership, Node
from scheduler.pass_runner import run_one_pass
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db


def test_nodes_list_their_gpus(as_charlie: Api, cluster: list[Node]) -> None:
    nodes = as_charlie.get("/api/v1/nodes/").json()
    assert [(n["name"], len(n["gpus"])) for n in nodes] == [
        ("node-a", 4),
        ("node-b", 2),
    ]
    assert nodes[0]["state"] == "up" and nodes[0]["takes_jobs"] is True
    one = as_charlie.get(f"/api/v1/nodes/{cluster[1].pk}/").json()
    assert one["name"] == "node-b"
    assert as_charlie.get("/api/v1/nodes/999999/").status_code == 404


def test_draining_needs_drain_node(
    as_alice: Api, alice: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    got = as_alice.post(f"/api/v1/nodes/{node.pk}/drain/")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    alice.user_permissions.add(Permission.objects.get(codename="drain_node"))
    got = as_alice.post(f"/api/v1/nodes/{node.pk}/drain/")
    assert got.json()["changed"] is True
    assert got.json()["node"]["mode"] == "draining"
    assert as_alice.post(f"/api/v1/nodes/{node.pk}/drain/").json()["changed"] is False
    assert as_alice.post(f"/api/v1/nodes/{node.pk}/resume/").json()["node"][
        "takes_jobs"
    ]
    node.refresh_from_db()
    assert node.draining is False
    # in the node's admin history, as the console's actions are, under alice
    history = LogEntry.objects.filter(object_id=str(node.pk)).order_by("pk")
    assert [(e.user_id, e.change_message) for e in history] == [
        (alice.pk, "drained"),
        (alice.pk, "resumed"),
    ]


def test_the_queue_shows_everyones_waiting_jobs(
    alice: User, charlie: User, as_bob: Api, cluster: list[Node]
) -> None:
    running = JobFactory(owner=alice)
    start_job(running, cluster[1])
    a = JobFactory(owner=alice, queue_order=2)
    c = JobFactory(owner=charlie, queue_order=1)
    JobFactory(owner=alice, status=Job.Status.COMPLETED)
    got = as_bob.get("/api/v1/queue/").json()
    assert [(j["id"], j["owner"], j["nodes"]) for j in got] == [
        (running.pk, "alice", ["node-b"]),
        (c.pk, "charlie", []),
        (a.pk, "alice", []),
    ]


def test_usage_is_mine_and_a_groups_for_its_leaders(
    as_alice: Api, as_bob: Api, alice: User
) -> None:
    mine = as_alice.get("/api/v1/usage/").json()
    assert mine["scope"] == "user alice"
    assert mine["gpu_hours"] == 0
    got = as_alice.get("/api/v1/usage/", group="vision")
    assert (got.status_code, got.json()["error"]) == (403, "permission_denied")
    Membership.objects.filter(user=alice).update(is_leader=True)
    assert as_alice.get("/api/v1/usage/", group="vision").json()["scope"] == (
        "group vision"
    )
    bad = as_bob.get("/api/v1/usage/", **{"from": "2026-02-30"})
    assert bad.status_code == 400 and "from" in bad.json()["fields"]


def test_me_names_the_token(as_alice: Api) -> None:
    me = as_alice.get("/api/v1/me/").json()
    assert (me["username"], me["groups"], me["token"]) == ("alice", ["vision"], "tests")


def test_the_schema_is_public_openapi_3(settings: Any) -> None:
    from django.test import Client

    got = Client().get("/api/v1/schema/", headers={"Accept": "application/json"})
    assert got.status_code == 200
    schema = got.json()
    assert schema["openapi"].startswith("3.")
    assert "/api/v1/jobs/{job_id}/logs/" in schema["paths"]


def test_usage_lists_the_jobs_that_used_most(
    alice: User, as_alice: Api, cluster: Any
) -> None:
    job = services.submit_job(
        alice, services.JobRequest(name="big", command="x", workdir="/tmp")
    )
    run_one_pass()
    attempt = Attempt.objects.get(job=job)
    services.mark_started(attempt.node_id, started_data(attempt, time.time() - 7200))
    services.finish_attempt(attempt.node_id, exited_data(attempt, 0))
    got = as_alice.get("/api/v1/usage/")
    assert got.status_code == 200, got.content
    top = got.json()["top_jobs"]
    assert [(t["job"], t["name"]) for t in top] == [(job.pk, "big")]
    assert 1.9 < top[0]["gpu_hours"] < 2.1
