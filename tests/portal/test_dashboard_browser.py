"""The dashboards in Chromium (Playwright) against Django's live server: what a
browser without JavaScript sees (the current state, server-rendered), and the
scripts drawing hostile strings as text (tiles and chart legends).

The live updates themselves need the ASGI server: tests/e2e/test_dashboard_browser.py.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client

from agents import protocol
from scheduler import metrics, services
from scheduler.models import Gpu, Job
from tests.browser import chromium, collect_errors
from tests.conftest import make_node
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from playwright.sync_api import Browser, BrowserContext

pytestmark = [pytest.mark.django_db(transaction=True)]

HOSTILE = '<img src=x onerror="window.__pwned=1"><b>bold</b>'


def session(user: User) -> str:
    """A signed-in session (made before the browser starts: inside a Playwright
    block Django refuses the ORM)."""
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


def signed_in(
    browser: Browser, live_server: Any, cookie: str, **options: Any
) -> BrowserContext:
    context = browser.new_context(**options)
    context.add_cookies(
        [
            {
                "name": settings.SESSION_COOKIE_NAME,
                "value": cookie,
                "url": live_server.url,
            }
        ]
    )
    return context


@pytest.fixture
def busy_cluster(alice: User, bob: User) -> dict[str, Any]:
    """node-a: GPU 0 runs alice's job at 91 %, GPU 1 has a foreign process;
    a waiting job of bob's with its reason; the job's output."""
    node, _ = make_node("node-a", 2)
    job = JobFactory(owner=alice, name=HOSTILE)
    attempt = start_job(job, node)
    services.mark_started(
        node.pk,
        protocol.JobStartedData(
            attempt_id=attempt.pk, job_id=job.pk, pid=5, started_at=1.0e9
        ),
    )
    gpu0, gpu1 = node.gpus.order_by("index")
    now = datetime.now(tz=UTC)
    Gpu.objects.filter(pk=gpu0.pk).update(
        latest={
            "util_gpu": 91.0,
            "memory_used_mib": 30720,
            "temperature_c": 70.0,
            "power_w": 300.0,
            "processes": [
                {"pid": 5, "used_memory_mib": 30000, "attempt_id": attempt.pk}
            ],
        },
        latest_at=now,
    )
    Gpu.objects.filter(pk=gpu1.pk).update(
        latest={"util_gpu": 12.0, "processes": [{"pid": 666, "used_memory_mib": 900}]},
        latest_at=now,
    )
    waiting = JobFactory(owner=bob, name="needs-eight", gpus=1)
    Job.objects.filter(pk=waiting.pk).update(
        queue_order=1, pending_message="waiting for a GPU: 0 of 2 free"
    )
    services.append_log(
        node.pk,
        protocol.JobLogData(
            attempt_id=attempt.pk, job_id=job.pk, offset=0, data=f"epoch 1 {HOSTILE}\n"
        ),
    )
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, now)
    metrics.store_samples(
        {0: gpu0.pk, 1: gpu1.pk},
        protocol.MetricsData(
            sampled_at=now.timestamp() - 60,
            gpus=[
                protocol.GpuSample(
                    index=0,
                    uuid=gpu0.uuid,
                    util_gpu=91.0,
                    processes=[
                        protocol.ProcessSample(
                            pid=5, used_memory_mib=30000, attempt_id=attempt.pk
                        )
                    ],
                ),
                protocol.GpuSample(
                    index=1,
                    uuid=gpu1.uuid,
                    util_gpu=12.0,
                    processes=[protocol.ProcessSample(pid=666, used_memory_mib=900)],
                ),
            ],
        ),
        now=now,
    )
    return {"node": node, "job": job, "waiting": waiting}


def test_without_javascript_every_page_shows_the_current_state(
    live_server: Any, alice: User, busy_cluster: dict[str, Any]
) -> None:
    from playwright.sync_api import expect

    node, job = busy_cluster["node"], busy_cluster["job"]
    cookie = session(alice)
    with chromium() as browser:
        context = signed_in(browser, live_server, cookie, java_script_enabled=False)
        page = context.new_page()

        page.goto(f"{live_server.url}/")
        tile = page.locator(f'[data-gpu="{node.pk}:0"]')
        expect(tile.locator('[data-f="util"]')).to_have_text("91%")
        expect(tile.locator('[data-f="mem"]')).to_have_text("30/80 GiB")
        expect(tile.locator(".h-name")).to_have_text(HOSTILE)
        expect(
            page.locator(f'[data-gpu="{node.pk}:1"] [data-f="foreign"]')
        ).to_have_text("⚠ foreign: 900 MiB")
        expect(page.locator('[data-h="busy"]')).to_have_text("1")
        expect(page.locator('[data-h="pending"]')).to_have_text("1")
        expect(page.locator("#live-status")).to_be_hidden()

        page.goto(f"{live_server.url}/jobs/{job.pk}/")
        expect(page.get_by_test_id("job-status")).to_have_text("running")
        expect(page.get_by_test_id("log")).to_have_text(f"epoch 1 {HOSTILE}\n")
        expect(page.locator("#job-gpus noscript")).to_have_count(1)

        page.goto(f"{live_server.url}/queue/")
        row = page.locator(f'tr[data-job="{busy_cluster["waiting"].pk}"]')
        expect(row.get_by_test_id("reason")).to_have_text(
            "waiting for a GPU: 0 of 2 free"
        )

        page.goto(f"{live_server.url}/nodes/{node.pk}/gpus/0/")
        expect(page.get_by_test_id("processes")).to_contain_text(f"#{job.pk}")
        assert page.locator("img").count() == 0


def test_scripts_draw_hostile_strings_as_text(
    live_server: Any, alice: User, busy_cluster: dict[str, Any]
) -> None:
    """The tile renderer (what applies live updates) and the charts' legends
    (Plotly reads tags in names) show a hostile name as typed."""
    from playwright.sync_api import expect

    node, job = busy_cluster["node"], busy_cluster["job"]
    cookie = session(alice)
    with chromium() as browser:
        context = signed_in(browser, live_server, cookie)
        page = context.new_page()
        errors = collect_errors(page)
        page.goto(f"{live_server.url}/")
        page.wait_for_function("() => !!(window.gpulab && window.gpulab.renderTile)")
        tile = page.locator(f'[data-gpu="{node.pk}:1"]')

        page.evaluate(
            """([key, name]) => window.gpulab.renderTile(
                 document.querySelector(`[data-gpu="${key}"]`),
                 {key, util: 95, mem: 1024, mem_total: 81920, temp: 60, power: 250,
                  at: 1, stale: false, state: "shared", reason: "", load: 4,
                  jobs: [{id: 1, name, owner: name, declared_mib: 2048, used_mib: 1024},
                         {id: 2, name: "</div><div>", owner: "x", declared_mib: null,
                          used_mib: null}],
                  foreign: [{pid: name, mib: 3}]})""",
            [f"{node.pk}:1", HOSTILE],
        )

        expect(tile.locator(".h-name").first).to_have_text(HOSTILE)
        expect(tile.locator(".h-owner").first).to_have_text(HOSTILE)
        expect(tile.locator(".h-name").nth(1)).to_have_text("</div><div>")
        expect(tile.locator('[data-f="foreign"]')).to_have_text("⚠ foreign: 3 MiB")
        expect(tile.locator('[data-f="foreign"]')).to_have_attribute(
            "title", f"processes no gpulab job owns: pid {HOSTILE} (3 MiB)"
        )
        expect(tile.locator('[data-f="shared"]')).to_be_visible()
        expect(tile.locator("img, b")).to_have_count(0)

        page.goto(f"{live_server.url}/nodes/{node.pk}/")
        legend = page.locator("#chart-procs .legendtext")
        expect(legend).to_have_text(
            [f"GPU 0: #{job.pk} {HOSTILE} (alice)", "GPU 1: foreign pid 666"]
        )
        expect(page.locator("#chart-procs .legendtext tspan")).to_have_count(0)
        page.goto(f"{live_server.url}/jobs/{job.pk}/")
        expect(page.get_by_test_id("log")).to_contain_text(HOSTILE)
        assert page.evaluate("window.__pwned === undefined")
        assert errors == []
