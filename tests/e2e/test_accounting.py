"""Two jobs sharing one GPU on real processes (web server, worker, a simulated
agent): when both have ended, each is charged its share of the GPU by declared
memory, from the agent-reported times, and together exactly the GPU's time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import Stack, csrf_post, login, wait_for_job
from tests.e2e.test_colocation import submit_shareable

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_two_jobs_sharing_a_gpu_are_each_charged_their_share(
    stack: Stack, alice: User, bob: User
) -> None:
    from scheduler.models import Attempt, UsageRecord

    _node, _agent = stack.start_node("e2e-charge", "1xA100-80GB", 1)
    mine = login(stack.base_url, "alice", "pw-alice")
    theirs = login(stack.base_url, "bob", "pw-bob")

    # alice declares 16 GiB and runs until cancelled; bob joins with 48 GiB
    first = submit_shareable(mine, "rn18", "ResNet-18 (batch size 32)", memory="16G")
    assert wait_for_job(first, {"running"}) == "running"
    second = submit_shareable(
        theirs, "lm", "LM (batch size 20)", command="sleep 3", memory="48G"
    )
    assert wait_for_job(second, {"running", "completed"}) in {"running", "completed"}
    assert wait_for_job(second, {"completed"}) == "completed"
    assert csrf_post(mine, f"/jobs/{first}/cancel/", {}).status_code == 302
    assert wait_for_job(first, {"cancelled"}) == "cancelled"

    a = Attempt.objects.get(job_id=first)
    b = Attempt.objects.get(job_id=second)
    assert a.started_at and a.ended_at and b.started_at and b.ended_at
    assert a.started_at < b.started_at < b.ended_at < a.ended_at  # b inside a
    overlap = (b.ended_at - b.started_at).total_seconds()
    whole = (a.ended_at - a.started_at).total_seconds()
    charged_a = UsageRecord.objects.get(attempt=a).gpu_seconds
    charged_b = UsageRecord.objects.get(attempt=b).gpu_seconds
    assert charged_b == pytest.approx(overlap * 48 / 64)
    assert charged_a == pytest.approx(whole - overlap + overlap * 16 / 64)
    assert charged_a + charged_b == pytest.approx(whole)  # once, not twice
    assert UsageRecord.objects.get(attempt=b).share == pytest.approx(0.75)
