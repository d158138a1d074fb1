"""Quota enforcement on real processes (ASGI server, Celery worker, a simulated
agent): a group over its hard GPU-hour quota gets its new job held PENDING with
the reason "quota exhausted", while another group's job, submitted later, starts
on the only GPU."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import Stack, csrf_post, login, submit, wait_for_job, wait_until

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_a_group_over_its_hard_quota_waits_and_another_group_starts(
    stack: Stack, alice: User, charlie: User, groups: dict
) -> None:
    from portal.quotas import services as quota_services
    from portal.quotas.models import Quota
    from scheduler.models import Job, UsageRecord

    stack.start_node("e2e-quota", "1xA100-80GB", 1)
    # 0.001 GPU-hours = 3.6 GPU-seconds: alice's first job (4 s) uses them up
    quota_services.save_quota(
        Quota(group=groups["vision"], gpu_hours=Decimal("0.001")), by=None
    )
    mine = login(stack.base_url, "alice", "pw-alice")
    theirs = login(stack.base_url, "charlie", "pw-charlie")

    first = submit(mine, "first", "sleep 4")
    assert wait_for_job(first, {"completed", "failed"}) == "completed"
    used = sum(
        UsageRecord.objects.filter(group=groups["vision"]).values_list(
            "gpu_seconds", flat=True
        )
    )
    assert used >= 3.6

    held = submit(mine, "held", "sleep 300")
    other = submit(theirs, "other", "sleep 300")
    assert wait_for_job(other, {"running"}) == "running"
    job = wait_until(
        lambda: Job.objects.filter(pk=held, pending_reason="quota").first(),
        what="the held job's quota reason",
    )
    assert job.status == Job.Status.PENDING
    assert job.attempts == 0
    assert job.pending_message.startswith("quota exhausted: group vision used 0.00")
    assert "of its 0.001 GPU-hours this month (hard limit); it resets at" in (
        job.pending_message
    )
    page = " ".join(mine.get(f"/jobs/{held}/").text.split())
    assert "quota exhausted: group vision" in page
    jobs_page = mine.get("/jobs/").text
    assert 'data-testid="quota-panel"' in jobs_page
    assert "used up: new jobs wait" in jobs_page

    for client, job_id in ((mine, held), (theirs, other)):
        assert csrf_post(client, f"/jobs/{job_id}/cancel/", {}).status_code == 302
    for job_id in (held, other):
        assert wait_for_job(job_id, set(Job.TERMINAL)) == "cancelled"
