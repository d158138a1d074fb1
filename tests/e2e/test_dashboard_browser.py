"""The live dashboards in a real browser on the real stack: uvicorn (HTTP and
websockets, channels_redis on Redis), a Celery worker, a simulated agent,
PostgreSQL; Chromium driven by Playwright.

A user logs in and submits a job through the forms, watches it start on its page
without a reload (state, output, charts), sees its GPU light up on the cluster
page (the latency from the agent's sample to the browser is printed), sees a
second job wait in the queue with its reason and cancels it there, cancels the
first; another user can neither open the job nor subscribe to it.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

import pytest

from tests.browser import chromium, collect_errors, log_in, outside_the_loop

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from django.contrib.auth.models import User
    from playwright.sync_api import Page

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Generous: the machine is shared; nothing here measures speed.
WAIT_MS = 90_000
HOSTILE = '<img src=x onerror="window.__pwned=1">'

SUBSCRIBE_AS_PAGE = """async (jobId) => {
  const ws = new WebSocket(`ws://${location.host}/ws/dashboard/`);
  const replies = [];
  await new Promise((ok, fail) => { ws.onopen = ok; ws.onerror = fail; });
  const reply = new Promise((ok) => { ws.onmessage = (ev) => ok(JSON.parse(ev.data)); });
  ws.send(JSON.stringify({subscribe: "job", id: jobId}));
  const first = await reply;
  ws.close();
  return first;
}"""


@contextlib.contextmanager
def logs_on_failure(stack: Stack) -> Iterator[None]:
    """A failed expectation shows what the processes said (the web server's
    log names the consumer that got stuck, the agent's the kill it never got)."""
    try:
        yield
    except AssertionError as exc:
        logs = "\n".join(
            f"--- {name} ---\n{proc.output(80)}" for name, proc in stack.procs.items()
        )
        raise AssertionError(f"{exc}\n{logs}") from exc


def submit_job(page: Page, base_url: str, name: str, gpus: int, util: int) -> int:
    page.goto(f"{base_url}/jobs/new/")
    page.fill("#id_name", name)
    page.fill(
        "#id_command",
        f"echo '{HOSTILE}'; for i in $(seq 600); do echo \"line $i\"; sleep 1; done",
    )
    page.fill("#id_gpus", str(gpus))
    page.fill("#id_env", f"GPULAB_SIM_UTIL={util}\nGPULAB_SIM_MEM_MIB=30000")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
    match = re.search(r"/jobs/(\d+)/$", page.url)
    assert match, page.url
    return int(match.group(1))


def gpu_key_of(job_id: int) -> str:
    from scheduler.models import Allocation

    def key() -> str:
        alloc = Allocation.objects.select_related("gpu").get(
            attempt__job_id=job_id, slot=0, released_at__isnull=True
        )
        return f"{alloc.gpu.node_id}:{alloc.gpu.index}"

    return outside_the_loop(key)


def test_a_user_watches_a_job_live_from_submit_to_cancel(
    stack: Stack,
    alice: User,
    charlie: User,
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    from playwright.sync_api import expect

    stack.start_node("gpu-node", "2xA100-80GB", 2)
    stack.procs["web"].wait_for(r"agent of node gpu-node connected")
    base = stack.base_url
    with logs_on_failure(stack), chromium() as browser:
        # Two windows of alice's: the cluster page, open before anything runs,
        # and the one she works in.
        mine = browser.new_context(viewport={"width": 1400, "height": 900})
        work = mine.new_page()
        work_errors = collect_errors(work)
        log_in(work, base, "alice", "pw-alice")
        board = mine.new_page()
        board_errors = collect_errors(board)
        board.goto(f"{base}/")
        expect(board.get_by_test_id("gpu-tile")).to_have_count(2)
        expect(board.locator("#live-status")).to_have_text("live", timeout=WAIT_MS)
        board.evaluate("window.__loaded = 'the first load'")

        # 1. Submit through the form; the job page follows it without a reload.
        job_id = submit_job(work, base, HOSTILE, gpus=1, util=93)
        work.evaluate("window.__loaded = 'the first load'")
        status = work.get_by_test_id("job-status")
        expect(status).to_have_text("running", timeout=WAIT_MS)
        log = work.get_by_test_id("log")
        expect(log).to_contain_text("line 3", timeout=WAIT_MS)
        expect(log).to_contain_text(HOSTILE)  # as text, not as an element
        expect(
            work.get_by_test_id("timeline").locator(".badge.st-running")
        ).to_have_count(1)
        expect(work.locator("#chart-util .scatterlayer .trace")).to_have_count(
            1, timeout=WAIT_MS
        )
        assert work.evaluate("window.__loaded") == "the first load"
        assert work.get_by_role("heading", name=f"#{job_id} {HOSTILE}").is_visible()

        # 2. Its GPU lights up on the cluster page, which was never reloaded.
        key = gpu_key_of(job_id)
        tile = board.locator(f'[data-gpu="{key}"]')
        expect(tile.locator('[data-f="util"]')).to_have_text(
            re.compile(r"^(8\d|9\d|100)%$"), timeout=WAIT_MS
        )
        expect(tile.locator(".h-name")).to_have_text(HOSTILE)
        expect(tile).to_have_class(re.compile(r"\bload-4\b"))
        sampled = float(tile.get_attribute("data-at") or 0)
        applied = float(tile.get_attribute("data-applied-at") or 0)
        expect(board.locator('[data-h="busy"]')).to_have_text("1")
        assert board.evaluate("window.__loaded") == "the first load"
        # Reported, never asserted (the figures are bench/live_dashboard.py's).
        record_property("live_latency_s", round(applied - sampled, 3))
        with capsys.disabled():
            print(  # noqa: T201 - the issue asks the observed latency be reported
                f"\n[live latency] agent sample -> cluster tile in the browser: "
                f"{applied - sampled:.3f} s (one observation)"
            )

        # 3. A job too big for the free GPU waits; the queue page shows it, live.
        queue = mine.new_page()
        queue_errors = collect_errors(queue)
        queue.goto(f"{base}/queue/")
        expect(queue.get_by_test_id("running")).to_contain_text(f"#{job_id}")
        waiting = submit_job(work, base, "needs-two", gpus=2, util=50)
        row = queue.locator(f'[data-testid="pending"] tr[data-job="{waiting}"]')
        expect(row.get_by_test_id("reason")).not_to_be_empty(timeout=WAIT_MS)
        expect(row.get_by_test_id("reason")).not_to_have_text(
            "waiting for the scheduler", timeout=WAIT_MS
        )
        row.get_by_role("button", name="Cancel").click()  # from the queue page
        expect(
            queue.locator(f'[data-testid="pending"] tr[data-job="{waiting}"]')
        ).to_have_count(0, timeout=WAIT_MS)

        # 4. Another user: no page, no subscription.
        theirs = browser.new_context()
        other = theirs.new_page()
        log_in(other, base, "charlie", "pw-charlie")
        response = other.goto(f"{base}/jobs/{job_id}/")
        assert response is not None and response.status == 404
        other.goto(f"{base}/")
        assert other.evaluate(SUBSCRIBE_AS_PAGE, job_id) == {"error": "no such job"}
        assert other.evaluate(SUBSCRIBE_AS_PAGE, waiting) == {"error": "no such job"}

        # 5. Cancel the first from its page: it ends live.
        work.goto(f"{base}/jobs/{job_id}/")
        work.evaluate("window.__loaded = 'after the cancel'")
        work.get_by_role("button", name="Cancel job").click()
        expect(work.get_by_test_id("job-status")).to_have_text(
            "cancelled", timeout=WAIT_MS
        )
        expect(board.locator('[data-h="busy"]')).to_have_text("0", timeout=WAIT_MS)
        expect(tile.locator(".t-free")).to_have_text("free")

        assert work.evaluate("window.__pwned") is None
        assert board.evaluate("window.__pwned") is None
        assert (work_errors, board_errors, queue_errors) == ([], [], [])


def test_a_node_page_extends_its_charts_live(stack: Stack, alice: User) -> None:
    from playwright.sync_api import expect

    node, _ = stack.start_node("chart-node", "2xA100-80GB", 2)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = collect_errors(page)
        log_in(page, stack.base_url, "alice", "pw-alice")
        page.goto(f"{stack.base_url}/nodes/{node.pk}/")

        chart = page.locator("#chart-util")
        expect(chart.locator(".scatterlayer .trace")).to_have_count(2)
        points = page.evaluate("document.getElementById('chart-util').data[0].x.length")
        # a node update a second: wait for three more points
        page.wait_for_function(
            "(n) => document.getElementById('chart-util').data[0].x.length >= n + 3",
            arg=points,
            timeout=WAIT_MS,
        )
        expect(page.locator("#chart-procs .main-svg").first).to_be_visible()
        # another range: the series again, at its resolution
        page.get_by_role("link", name="6h").click()
        expect(page.locator("#resolution")).to_have_text("(1-minute means)")
        assert page.url.endswith("?range=6h")
        assert errors == []
