"""The job page in a real browser on the real stack (uvicorn, a Celery worker, a
simulated agent running the job's command, PostgreSQL, Redis): what it shows
changes without a reload when the job reports something new.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.browser import chromium, collect_errors, log_in
from tests.e2e.conftest import login, submit, wait_for_job, wait_until

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Generous: the machine is shared; nothing here measures speed. The agent sends a
# job's progress at most every agents.progress.INTERVAL_S (10 s).
WAIT_MS = 90_000


def reported_step(job_id: int) -> int | None:
    from scheduler.models import Attempt

    return (
        Attempt.objects.filter(job_id=job_id)
        .values_list("progress_step", flat=True)
        .first()
    )


def test_the_progress_line_follows_the_reports_without_a_reload(
    stack: Stack, alice: User
) -> None:
    from playwright.sync_api import expect

    stack.start_node("progress-node", "1xA100-80GB", 1)
    gate = stack.tmp / "go-on"
    client = login(stack.base_url, "alice", "pw-alice")
    job_id = submit(
        client,
        "trains",
        "echo GPULAB_PROGRESS 1/30; "
        f"while [ ! -e {gate} ]; do sleep 0.1; done; "
        "echo GPULAB_PROGRESS 15/30; sleep 600",
    )
    wait_for_job(job_id, {"running"})
    wait_until(lambda: reported_step(job_id) == 1, 60, "the first progress report")

    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = collect_errors(page)
        log_in(page, stack.base_url, "alice", "pw-alice")
        page.goto(f"{stack.base_url}/jobs/{job_id}/")
        progress = page.get_by_test_id("progress")
        expect(progress).to_contain_text("step 1 of 30")
        expect(page.locator("#live-status")).to_have_text("live", timeout=WAIT_MS)
        page.evaluate("window.__loaded = 'the first load'")

        gate.touch()  # the job prints its next progress line
        expect(progress).to_contain_text("step 15 of 30 (50%)", timeout=WAIT_MS)
        assert page.evaluate("window.__loaded") == "the first load"  # no reload
        assert errors == []
