"""The bar "the same through OpenID Connect": a user known only to the identity
provider signs in through the browser, lands in the group its claims say, submits a
job, and the job runs on a simulated node under the uid and gids of its claims
(20001, absent from this machine's /etc/passwd)."""

from __future__ import annotations

import os
import pwd
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

from tests.browser import chromium, collect_errors, outside_the_loop
from tests.e2e.conftest import submit_in_browser, wait_for_job
from tests.oidc.conftest import lab_user
from tests.oidc.test_flow_browser import WAIT_MS, sign_in_at_provider

if TYPE_CHECKING:
    from tests.e2e.conftest import Stack
    from tests.oidc.conftest import Provider

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_provider_only_user_runs_a_job_under_the_claimed_uid(
    oidc_env: dict[str, str], stack: Stack, provider: Provider
) -> None:
    with pytest.raises(KeyError):
        pwd.getpwuid(20001)  # only the provider knows ada
    assert os.geteuid() == 0, "the agent must run as root to switch accounts"
    provider.seed(
        [lab_user("ada", uid="20001", gid=20001, gids=[20001, 3000])],
        redirect_base=stack.base_url,
    )
    stack.start_node("oidc-node", "1xA100-80GB", 1)
    base = stack.base_url
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = collect_errors(page)
        sign_in_at_provider(page, stack, provider, "ada")
        page.wait_for_url(f"{base}/", timeout=WAIT_MS)

        page.goto(f"{base}/jobs/new/")
        # Her group, from the claims, is the one charged by default.
        expect(page.locator("#id_group")).to_contain_text("default (vision)")
        job_id = submit_in_browser(
            page, base, "whoami", "id -u; id -G; echo user=$USER"
        )

        state = outside_the_loop(
            lambda: wait_for_job(job_id, {"completed", "failed"}, timeout=120)
        )
        assert state == "completed", stack.procs["agent-oidc-node"].output()
        page.reload()
        expect(page.get_by_test_id("log")).to_contain_text("20001")
        assert errors == []
    lines = outside_the_loop(lambda: log_lines(job_id))
    assert lines[0] == "20001"
    assert sorted(lines[1].split()) == ["20001", "3000"]
    assert lines[2] == "user=ada"


def log_lines(job_id: int) -> list[str]:
    from scheduler.models import JobLogChunk

    text = "".join(
        JobLogChunk.objects.filter(attempt__job_id=job_id)
        .order_by("offset")
        .values_list("data", flat=True)
    )
    return text.splitlines()
