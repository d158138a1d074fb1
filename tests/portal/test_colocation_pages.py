"""Two jobs sharing a GPU, as people see them: both in the GPU's row on /nodes/
with their memory, and each job's page naming its partner and why it was
admitted."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.test import Client

from scheduler import services
from scheduler.models import Gpu
from tests.conftest import make_node
from tests.factories import JobFactory, shared_start, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Job

pytestmark = pytest.mark.django_db


def page(user: User, url: str) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200
    return " ".join(response.content.decode().split())


@pytest.fixture
def pair(alice: User, bob: User) -> tuple[Job, Job]:
    node, _ = make_node("node-a", 1)
    first = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4096, name="rn18")
    start_job(first, node)
    second = JobFactory(owner=bob, shareable=True, gpu_memory_mib=6144, name="lm")
    gpu = node.gpus.get()
    assert services.apply_decisions(
        [shared_start(second, gpu.pk, node.pk, (first.pk,))]
    ).started
    # the agent's latest sample: each job's processes and their memory
    attempts = {j.pk: j.attempt_set.get().pk for j in (first, second)}
    Gpu.objects.filter(pk=gpu.pk).update(
        latest={
            "processes": [
                {"pid": 10, "used_memory_mib": 3000, "attempt_id": attempts[first.pk]},
                {"pid": 11, "used_memory_mib": 5000, "attempt_id": attempts[second.pk]},
            ]
        }
    )
    return first, second


def test_the_nodes_page_shows_both_jobs_of_a_shared_gpu_with_their_memory(
    alice: User, pair: tuple[Job, Job]
) -> None:
    first, second = pair

    body = page(alice, "/nodes/")

    assert 'data-testid="shared">shared' in body
    # alice's own job links to its page; bob's is shown, not linked (a 404 for her)
    assert f'title="#{first.pk} rn18 (alice): 2.9 GiB used of 4.0 GiB declared"' in body
    assert (
        f'<a href="/jobs/{first.pk}/">#{first.pk}</a> <span class="h-name">rn18' in body
    )
    assert f'title="#{second.pk} lm (bob): 4.9 GiB used of 6.0 GiB declared"' in body
    assert f'<span>#{second.pk}</span> <span class="h-name">lm</span>' in body
    assert f'<a href="/jobs/{second.pk}/">' not in body


def test_each_jobs_page_names_its_partner_and_the_admission(
    alice: User, bob: User, pair: tuple[Job, Job]
) -> None:
    first, second = pair

    mine = page(alice, f"/jobs/{first.pk}/")
    theirs = page(bob, f"/jobs/{second.pk}/")

    assert (
        f'Shares its GPU with</dt><dd data-testid="partners">job #{second.pk} (bob, 6.0 GiB declared)'
        in mine
    )
    assert "Co-location" not in mine  # it was there first
    assert f"job #{first.pk} (alice, 4.0 GiB declared)" in theirs
    assert f"joined a GPU running job(s) {first.pk}: predicted gain 1.60" in theirs
