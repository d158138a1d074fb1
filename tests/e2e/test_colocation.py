"""Two shareable jobs on one GPU, on real processes: the pass admits the second
beside the first (an exploration trial: the pair was never seen), the agent runs
both on the same GPU, and /nodes/ and each job's page show the two of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import Stack, csrf_post, login, submit, wait_for_job, wait_until

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def submit_shareable(
    client, name: str, workload: str, command: str = "sleep 300", memory: str = "8G"
) -> int:
    return submit(
        client, name, command, gpu_memory=memory, shareable="on", workload=workload
    )


def test_two_shareable_jobs_share_one_gpu_and_both_show(
    stack: Stack, alice: User, bob: User
) -> None:
    from scheduler.models import Allocation, Attempt, Job

    node, _agent = stack.start_node("e2e-share", "1xA100-80GB", 1)
    mine = login(stack.base_url, "alice", "pw-alice")
    theirs = login(stack.base_url, "bob", "pw-bob")

    first = submit_shareable(mine, "rn18", "ResNet-18 (batch size 32)")
    assert wait_for_job(first, {"running"}) == "running"
    second = submit_shareable(theirs, "lm", "LM (batch size 20)")
    assert wait_for_job(second, {"running"}) == "running"

    # one GPU, both jobs, one slot each
    gpu = node.gpus.get()
    live = Allocation.objects.filter(gpu=gpu, released_at__isnull=True)
    assert sorted(live.values_list("attempt__job_id", "slot")) == [
        (first, 0),
        (second, 1),
    ]
    joined = Attempt.objects.get(job_id=second)
    assert joined.admission["trial"] is True
    assert joined.admission["partners"] == [first]

    nodes_page = " ".join(mine.get("/nodes/").text.split())
    assert 'data-testid="shared">shared' in nodes_page
    assert f"#{first} rn18" in nodes_page and f"#{second} lm" in nodes_page
    assert nodes_page.count("8.0 GiB declared") == 2
    first_page = " ".join(mine.get(f"/jobs/{first}/").text.split())
    assert f"job #{second} (bob, 8.0 GiB declared)" in first_page
    second_page = " ".join(theirs.get(f"/jobs/{second}/").text.split())
    assert f"joined a GPU running job(s) {first}: exploration trial" in second_page

    for client, job_id in ((mine, first), (theirs, second)):
        assert csrf_post(client, f"/jobs/{job_id}/cancel/", {}).status_code == 302
    for job_id in (first, second):
        assert wait_for_job(job_id, set(Job.TERMINAL)) == "cancelled"
    wait_until(
        lambda: not Allocation.objects.filter(released_at__isnull=True).exists(),
        what="the GPU's slots released",
    )
