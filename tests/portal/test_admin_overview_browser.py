"""The admin overview in a real browser (Playwright driving Debian's Chromium):
the utilisation and idle charts render from the page's data."""

from __future__ import annotations

import shutil
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from scheduler.models import GpuRollup
from tests.conftest import make_node

if TYPE_CHECKING:
    from django.contrib.auth.models import User

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

# No skip without Chromium: `make test` and .ci/run install it, and a missing
# browser must fail, not pass silently.
pytestmark = [pytest.mark.django_db(transaction=True)]


def test_the_overview_chart_renders(live_server: Any, admin_user: User) -> None:
    from playwright.sync_api import expect, sync_playwright

    node, _ = make_node("node-a", 2)
    gpu = node.gpus.order_by("index")[0]
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    GpuRollup.objects.create(
        gpu=gpu, resolution="1h", start=hour - timedelta(hours=1), samples=360,
        util_gpu_mean=42.0,
    )  # fmt: skip
    client = Client()
    client.force_login(admin_user)
    session = client.cookies[settings.SESSION_COOKIE_NAME].value

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            context = browser.new_context()
            context.add_cookies(
                [
                    {
                        "name": settings.SESSION_COOKIE_NAME,
                        "value": session,
                        "url": live_server.url,
                    }
                ]
            )
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{live_server.url}/admin/overview/")

            chart = page.get_by_test_id("utilisation-chart")
            expect(chart.locator(".main-svg").first).to_be_visible()
            # one bar series (held) and one line (measured utilisation)
            expect(chart.locator(".legendtext")).to_have_text(
                ["held by jobs (%)", "used: mean utilisation (%)"]
            )
            expect(chart.locator(".scatterlayer .trace .point")).to_have_count(1)
            expect(
                page.get_by_test_id("idle-chart").locator(".main-svg").first
            ).to_be_visible()
            assert errors == []
        finally:
            browser.close()
