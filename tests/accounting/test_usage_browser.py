"""The Usage page in a real browser (Debian's Chromium through Playwright): the
Plotly stacked area renders one trace per user."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import pytest

from tests.accounting.test_usage_pages import DAY, lead

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("quiet", "send"),
]


def test_the_usage_chart_renders_a_stacked_area_per_user(
    live_server: Any, client: Client, alice: User, usage: None
) -> None:
    from playwright.sync_api import sync_playwright

    lead(alice, "vision")
    client.force_login(alice)
    session = client.cookies["sessionid"].value

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = browser.new_context()
            context.add_cookies(
                [{"name": "sessionid", "value": session, "url": live_server.url}]
            )
            page = context.new_page()
            page.goto(f"{live_server.url}/usage/?group=vision&{DAY}")
            page.wait_for_selector("#usage-chart .main-svg")
            traces = page.evaluate(
                "() => document.getElementById('usage-chart').data"
                ".map(t => [t.name, t.stackgroup, t.y])"
            )
            legend = page.evaluate(
                "() => Array.from(document.querySelectorAll("
                "'#usage-chart .legendtext')).map(e => e.textContent)"
            )
            drawn = page.locator("#usage-chart .scatterlayer .trace").count()
        finally:
            browser.close()

    assert sorted(traces) == [
        ["alice", "users", [pytest.approx(2.0)]],
        ["bob", "users", [pytest.approx(0.5)]],
    ]
    assert sorted(legend) == ["alice", "bob"]
    assert drawn == 2  # both areas are in the plot's SVG
