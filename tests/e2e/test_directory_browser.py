"""The bar of LDAP sign-in, end to end: a user who exists only in the lab's
directory (a real slapd) signs in through the login page in a real browser, lands
in the right group, submits a job from the form, and the job runs on a simulated
node under their directory uid, 20001, which this machine's /etc/passwd does not
know (the agent, running as root, switches to the numbers the launch carries)."""

from __future__ import annotations

import os
import pwd
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser import chromium, collect_errors, log_in, outside_the_loop
from tests.directory.slapd import start_slapd
from tests.e2e.conftest import submit_in_browser, wait_for_job

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from tests.directory.slapd import Slapd
    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: dict[str, Any]
) -> Iterator[Slapd]:
    """slapd, and the portal's processes (started after this) pointed at it."""
    server = start_slapd(tmp_path / "slapd")
    for name, value in {
        **server.settings(),
        "GPULAB_DIRECTORY_GROUP_MAP": "vision-lab=vision,nlp-lab=nlp",
        "GPULAB_DIRECTORY_LEADER_GROUPS": "vision-pis=vision",
        "GPULAB_LOCAL_LOGIN": "staff",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        yield server
    finally:
        server.stop()


def test_a_directory_user_signs_in_and_runs_under_their_uid(
    directory: Slapd, stack: Stack
) -> None:
    from playwright.sync_api import expect

    with pytest.raises(KeyError):
        pwd.getpwuid(20001)  # only the directory knows dora
    assert os.geteuid() == 0, "the agent must run as root to switch accounts"
    stack.start_node("ldap-node", "1xA100-80GB", 1)
    base = stack.base_url
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = collect_errors(page)
        log_in(page, base, "dora", "dora-pw-1")
        expect(page.locator("body")).to_contain_text("dora")

        page.goto(f"{base}/jobs/new/")
        # Her group, from the directory, is the one charged by default.
        expect(page.locator("#id_group")).to_contain_text("default (vision)")
        job_id = submit_in_browser(
            page, base, "whoami", "id -u; id -G; echo user=$USER"
        )

        state = outside_the_loop(
            lambda: wait_for_job(job_id, {"completed", "failed"}, timeout=120)
        )
        assert state == "completed", stack.procs["agent-ldap-node"].output()
        page.reload()
        log = page.get_by_test_id("log")
        expect(log).to_contain_text("20001")
        assert errors == []
    lines = log_lines(job_id)
    assert lines[0] == "20001"
    assert sorted(lines[1].split()) == ["20001", "5000"]
    assert lines[2] == "user=dora"
    assert outside_the_loop(lambda: _job_group(job_id)) == "vision"


def _job_group(job_id: int) -> str:
    from scheduler.models import Job

    return Job.objects.select_related("group").get(pk=job_id).group.name


def log_lines(job_id: int) -> list[str]:
    from scheduler.models import JobLogChunk

    text = "".join(
        JobLogChunk.objects.filter(attempt__job_id=job_id)
        .order_by("offset")
        .values_list("data", flat=True)
    )
    return text.splitlines()
