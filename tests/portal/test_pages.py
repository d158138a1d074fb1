"""Cluster pages: overview, queue, nodes, node detail."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.urls import reverse

from scheduler.models import Node
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

PAGES = ["portal-overview", "portal-queue", "portal-nodes"]


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("name", PAGES)
def test_it_sends_anonymous_users_to_login(db: None, name: str) -> None:
    response = Client().get(reverse(name))

    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))


def test_it_sends_anonymous_users_to_login_from_a_node(
    cluster: list[Node],
) -> None:
    response = Client().get(reverse("portal-node", args=[cluster[0].pk]))

    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))


@pytest.mark.parametrize("name", ["portal-overview", "portal-nodes"])
@pytest.mark.parametrize("persona", ["alice", "bob", "charlie"])
def test_it_shows_every_node_and_gpu(
    request: pytest.FixtureRequest, cluster: list[Node], name: str, persona: str
) -> None:
    response = client_for(request.getfixturevalue(persona)).get(reverse(name))

    body = response.content.decode()
    assert response.status_code == 200
    assert "node-a" in body
    assert "node-b" in body
    assert body.count("NVIDIA A100-80GB") == 6
    assert body.count('class="badge node-up"') == 2


def test_it_shows_the_node_detail(alice: User, cluster: list[Node]) -> None:
    node_b = cluster[1]

    response = client_for(alice).get(reverse("portal-node", args=[node_b.pk]))

    body = response.content.decode()
    assert response.status_code == 200
    assert "node-b" in body
    assert "node-a" not in body
    assert body.count("NVIDIA A100-80GB") == 2


def test_it_gives_404_for_an_unknown_node(alice: User, cluster: list[Node]) -> None:
    response = client_for(alice).get(reverse("portal-node", args=[999_999]))

    assert response.status_code == 404


def test_it_shows_a_lost_node_and_a_lost_gpu(alice: User, cluster: list[Node]) -> None:
    node_a = cluster[0]
    Node.objects.filter(pk=node_a.pk).update(status=Node.Status.LOST)
    node_a.gpus.filter(index=3).update(present=False)

    body = client_for(alice).get(reverse("portal-nodes")).content.decode()

    assert 'class="badge node-lost"' in body
    assert "GPU lost" in body


def test_it_shows_which_job_holds_a_gpu(
    alice: User, charlie: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice, name="busy-job")
    start_job(job, cluster[1])

    body = client_for(charlie).get(reverse("portal-nodes")).content.decode()

    assert f"#{job.pk} busy-job" in body
    assert body.count(">free<") == 5


def test_it_escapes_job_names_on_the_node_grid(
    alice: User, cluster: list[Node]
) -> None:
    start_job(JobFactory(owner=alice, name="<b>x</b>"), cluster[1])

    body = client_for(alice).get(reverse("portal-nodes")).content.decode()

    assert "<b>x</b>" not in body
    assert "&lt;b&gt;x&lt;/b&gt;" in body


def test_it_shows_the_queue(alice: User, cluster: list[Node]) -> None:
    JobFactory(owner=alice, name="waiting-job")
    start_job(JobFactory(owner=alice, name="running-job"), cluster[0])

    response = client_for(alice).get(reverse("portal-queue"))

    body = response.content.decode()
    assert response.status_code == 200
    assert [j.name for j in response.context["pending"]] == ["waiting-job"]
    assert [j.name for j in response.context["running"]] == ["running-job"]
    assert "waiting-job" in body
    assert "running-job" in body


def test_it_returns_only_the_cluster_fragment_to_htmx(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).get(
        reverse("portal-overview"), headers={"HX-Request": "true"}
    )

    names = {t.name for t in response.templates}
    assert response.status_code == 200
    assert "portal/partials/_cluster.html" in names
    assert "portal/overview.html" not in names
