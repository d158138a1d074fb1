"""The Usage page in a real browser (Debian's Chromium through Playwright): the
Plotly stacked area renders one trace per user on the chosen range's axis, and a
range without GPU time says so instead of an empty chart."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import pytest

from tests.accounting.test_usage_pages import DAY, lead

WEEK = "from=2027-01-15&to=2027-01-21"

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [
    pytest.mark.django_db(transaction=True),
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
            # a week with GPU time on its first day only: the axis is the week
            page.goto(f"{live_server.url}/usage/?group=vision&{WEEK}")
            page.wait_for_selector("#usage-chart .main-svg")
            week_axis = page.evaluate(
                "() => document.getElementById('usage-chart').layout.xaxis.range"
            )
        finally:
            browser.close()

    assert sorted(traces) == [
        ["alice", "users", [pytest.approx(2.0)]],
        ["bob", "users", [pytest.approx(0.5)]],
    ]
    assert sorted(legend) == ["alice", "bob"]
    assert drawn == 2  # both areas are in the plot's SVG
    assert [a[:10] for a in week_axis] == ["2027-01-15", "2027-01-21"]


def test_a_range_without_gpu_time_says_so_instead_of_an_empty_chart(
    live_server: Any, client: Client, alice: User, usage: None
) -> None:
    from playwright.sync_api import sync_playwright

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
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{live_server.url}/usage/?from=2026-12-01&to=2026-12-31")
            message = page.locator("#usage-empty").inner_text()
            charts = page.locator("#usage-chart").count()
            svgs = page.locator(".main-svg").count()
            total = page.locator("#usage-total").inner_text()
        finally:
            browser.close()

    assert message == "No GPU time in this range (2026-12-01 to 2026-12-31)."
    assert charts == 0 and svgs == 0  # no empty year-2000 axis
    assert total == "0.0"
    assert errors == []
