"""The job and queue pages fetch their fragment again when a change is announced;
two fetches that overlap may complete out of order. Replayed deterministically
in a real browser on the real stack: each page's first fragment request is
answered by the server at once (the job still running) but its response is
held back by Playwright (``page.route``) until the job has ended and the page's
next fetch has completed; then it is delivered, late. The page must end showing
the job ended, not the held-back, older state (the latest request wins:
``gl.latestWins`` in static/portal/js/live.js).

This was the root cause of the intermittently flaky
``test_dashboard_browser.py``: the job page folded a change announced during a
fetch into that fetch (which predated it) and kept "running" after the job
ended; the queue page drew whichever response came last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pytest

from tests.browser import chromium, collect_errors, log_in, outside_the_loop
from tests.e2e.conftest import login, submit, wait_for_job

if TYPE_CHECKING:
    from pathlib import Path

    from django.contrib.auth.models import User
    from playwright.sync_api import APIResponse, Page, Request, Route

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WAIT_MS = 60_000
# Long enough for a page to fetch again after the job.status or queue.changed
# it got (it does so at once, or 200-300 ms later when debounced); only a page
# that never fetches again (the bug) waits it out, and then fails below.
NEXT_FETCH_MS = 15_000

# Counts the page's fragment fetches (those with the HX-Request header) once
# the page's own code is done with their response: a timer set when the body
# was read runs after the promise callbacks that draw it. `held` counts the
# held-back response (marked by a header this test adds).
COUNT_FRAGMENTS = """
(() => {
  const seen = (window.__fragments = { started: 0, settled: 0, held: 0 });
  const fetch = window.fetch.bind(window);
  const later = (fn) => setTimeout(fn, 0);
  window.fetch = (input, init) => {
    const headers = (init && init.headers) || {};
    if (!headers["HX-Request"]) return fetch(input, init);
    seen.started += 1;
    return fetch(input, init).then(
      (resp) => {
        const text = resp.text.bind(resp);
        const held = resp.headers.get("x-test-held") === "1";
        resp.text = () =>
          text().finally(() =>
            later(() => {
              seen.settled += 1;
              if (held) seen.held += 1;
            }),
          );
        return resp;
      },
      (err) => {
        later(() => (seen.settled += 1));
        throw err;
      },
    );
  };
})();
"""


@dataclass
class HoldFirst:
    """A route handler: the first fragment request of ``path`` is sent to the
    server at once, its response kept until ``release``; the others pass."""

    path: str
    held: list[tuple[Route, APIResponse]] = field(default_factory=list)

    def __call__(self, route: Route, request: Request) -> None:
        fragment = (
            request.resource_type == "fetch"
            and urlparse(request.url).path == self.path
            and request.headers.get("hx-request") == "true"
        )
        if fragment and not self.held:
            self.held.append((route, route.fetch()))
            return
        route.fallback()

    def wait_held(self, page: Page) -> None:
        """Until the page made its first fragment request (route handlers run
        while Playwright waits: a bounded wait, in short steps)."""
        for _ in range(WAIT_MS // 50):
            if self.held:
                return
            page.wait_for_timeout(50)
        raise AssertionError(f"{page.url}: no fragment request for {self.path}")

    def release(self, page: Page) -> None:
        """Deliver the held response (the older state) and wait until the page's
        code has handled it."""
        route, response = self.held[0]
        route.fulfill(
            response=response, headers={**response.headers, "x-test-held": "1"}
        )
        page.wait_for_function("window.__fragments.held === 1", timeout=WAIT_MS)


def settled_after(page: Page, count: int) -> bool:
    """True once ``count`` more fragment fetches than the held one settled; False
    if the page made no such fetch within NEXT_FETCH_MS."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "(n) => window.__fragments.settled - window.__fragments.held >= n",
            arg=count,
            timeout=NEXT_FETCH_MS,
        )
    except PlaywrightTimeout:
        return False
    return True


def test_a_late_older_fragment_never_overwrites_a_newer_one(
    stack: Stack, alice: User, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    stack.start_node("race-node", "1xA100-80GB", 1)
    client = login(stack.base_url, "alice", "pw-alice")
    marker = tmp_path / "finish"
    job_id = submit(
        client,
        "raced",
        f"echo started; while [ ! -e {marker} ]; do sleep 0.1; done",
    )
    assert wait_for_job(job_id, {"running"}) == "running"
    base = stack.base_url

    with chromium() as browser:
        context = browser.new_context()
        context.add_init_script(COUNT_FRAGMENTS)
        log_in(context.new_page(), base, "alice", "pw-alice")
        # The job page and the queue page, each fetching its fragment once
        # subscribed (to catch up with changes since the render): held back.
        job_page, queue_page = context.new_page(), context.new_page()
        errors = (collect_errors(job_page), collect_errors(queue_page))
        job_held = HoldFirst(f"/jobs/{job_id}/")
        queue_held = HoldFirst("/queue/")
        job_page.route("**/*", job_held)
        queue_page.route("**/*", queue_held)
        job_page.goto(f"{base}/jobs/{job_id}/")
        queue_page.goto(f"{base}/queue/")
        job_held.wait_held(job_page)
        queue_held.wait_held(queue_page)
        running_row = queue_page.locator(
            f'[data-testid="running"] tr[data-job="{job_id}"]'
        )
        expect(running_row).to_have_count(1)

        marker.touch()  # the job ends while both pages' first fetch is held
        ended = outside_the_loop(lambda: wait_for_job(job_id, {"completed", "failed"}))
        assert ended == "completed"
        # The pages hear of it (job.status; queue.changed) and fetch again:
        # those fetches complete first and show the ended job.
        expect(job_page.get_by_test_id("job-status")).to_have_text(
            "completed", timeout=WAIT_MS
        )
        fetched_again = settled_after(job_page, 1)
        assert settled_after(queue_page, 1), "the queue page never fetched again"
        expect(running_row).to_have_count(0)

        # Now the older responses arrive, last.
        job_held.release(job_page)
        queue_held.release(queue_page)

        expect(job_page.locator("#job-state")).to_have_attribute(
            "data-status", "completed"
        )
        expect(job_page.get_by_test_id("job-status")).to_have_text("completed")
        expect(running_row).to_have_count(0)
        assert fetched_again, "the job page did not fetch again after the job ended"
        assert errors == ([], [])
