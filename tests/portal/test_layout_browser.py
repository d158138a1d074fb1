"""Layout measured in Chromium (Playwright, Django's live server): what a new
user found broken. A shared GPU's tile keeps its header on one line; the Usage
page's top-jobs table is styled like the other tables and its range form lays
its fields out side by side with room between them; the submit form names the
group a job is charged to by default and shows its choices unclipped."""

from __future__ import annotations

import time
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import pytest
from django.conf import settings
from django.test import Client

from scheduler import services
from scheduler.models import Gpu
from tests.browser import chromium, collect_errors
from tests.conftest import make_node
from tests.factories import JobFactory, shared_start, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from playwright.sync_api import Page

pytestmark = [pytest.mark.django_db(transaction=True)]

# A laptop's window: the tiles at their narrowest column.
VIEWPORT = {"width": 1100, "height": 900}
# The submit form's fields at their narrowest (three columns of 260 px).
NARROW_FORM = 910


@pytest.fixture
def shared_gpu(alice: User, bob: User) -> Any:
    """node-a's GPU 0 runs two of alice's jobs (the second joined), at 100 %;
    GPU 1 is free."""
    node, _ = make_node("node-a", 2)
    gpu0 = node.gpus.get(index=0)
    first = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4096, name="rn18")
    attempt = start_job(first, node, [gpu0])
    services.mark_started(node.pk, started_data(attempt, time.time() - 3600))
    second = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4096, name="lm")
    assert services.apply_decisions(
        [shared_start(second, gpu0.pk, node.pk, (first.pk,))]
    ).started
    Gpu.objects.filter(pk=gpu0.pk).update(
        latest={"util_gpu": 100.0, "memory_used_mib": 8000, "processes": []},
    )
    return node


def session(user: User) -> str:
    """A signed-in session, made before the browser starts (inside a Playwright
    block Django refuses the ORM)."""
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


def opened(
    browser: Any, live_server: Any, cookie: str, width: int = VIEWPORT["width"]
) -> Page:
    context = browser.new_context(viewport={**VIEWPORT, "width": width})
    context.add_cookies(
        [
            {
                "name": settings.SESSION_COOKIE_NAME,
                "value": cookie,
                "url": live_server.url,
            }
        ]
    )
    return context.new_page()


ONE_LINE = """(el) => {
  const tops = [...el.children].filter((c) => !c.hidden).map((c) => {
    const rects = [...c.getClientRects()];
    return {rects: rects.length, top: rects[0].top};
  });
  return {
    wrapped: tops.filter((t) => t.rects !== 1).length,
    spread: Math.max(...tops.map((t) => t.top)) - Math.min(...tops.map((t) => t.top)),
    height: el.getBoundingClientRect().height,
    clipped: el.scrollWidth > el.clientWidth,
  };
}"""


def test_a_shared_gpus_tile_keeps_its_header_on_one_line(
    live_server: Any, alice: User, shared_gpu: Any
) -> None:
    node = shared_gpu
    cookie = session(alice)
    with chromium() as browser:
        page = opened(browser, live_server, cookie)
        errors = collect_errors(page)
        page.goto(f"{live_server.url}/")
        tile = page.locator(f'[data-gpu="{node.pk}:0"]')
        shared = tile.locator(".t-top")
        free = page.locator(f'[data-gpu="{node.pk}:1"] .t-top')
        assert tile.locator('[data-f="shared"]').is_visible()

        header = shared.evaluate(ONE_LINE)
        alone = free.evaluate(ONE_LINE)

        assert header["wrapped"] == 0, header
        assert not header["clipped"], header  # on one line, and whole
        assert header["spread"] < 8, header
        assert header["height"] <= alone["height"] + 1, (header, alone)
        # The badge's line too.
        env = tile.locator(".t-env").evaluate(ONE_LINE)
        assert env["wrapped"] == 0, env
        assert not env["clipped"], env
        assert errors == []


def test_the_usage_page_styles_its_table_and_spaces_its_range_form(
    live_server: Any, alice: User, shared_gpu: Any
) -> None:
    cookie = session(alice)
    with chromium() as browser:
        page = opened(browser, live_server, cookie)
        page.goto(f"{live_server.url}/usage/")
        cell = page.locator("#top-jobs th").first
        style = cell.evaluate(
            """(el) => { const s = getComputedStyle(el);
                return {pad: parseFloat(s.paddingLeft),
                        line: parseFloat(s.borderBottomWidth)}; }"""
        )
        assert style["pad"] >= 6, style  # not the browser's 1 px
        assert style["line"] >= 1, style

        boxes = [
            page.locator(f"#usage-range {sel}").bounding_box()
            for sel in ("input[name=from]", "input[name=to]", "button")
        ]
        assert all(boxes), boxes
        for left, right in pairwise(boxes):
            assert left is not None and right is not None
            gap = right["x"] - (left["x"] + left["width"])
            assert gap >= 8, (left, right)  # side by side, with room
            assert abs(right["y"] + right["height"] - left["y"] - left["height"]) < 4


def test_the_submit_form_names_the_default_group_and_shows_its_choices_whole(
    live_server: Any, alice: User
) -> None:
    cookie = session(alice)
    with chromium() as browser:
        page = opened(browser, live_server, cookie, NARROW_FORM)
        page.goto(f"{live_server.url}/jobs/new/")

        assert page.locator("#id_group option").first.inner_text() == (
            "default (vision)"
        )
        for select in page.locator(".job-form select").all():
            # The widest option's text, in the select's font, fits its box.
            fits = select.evaluate(
                """(el) => {
                  const s = getComputedStyle(el);
                  const ctx = document.createElement("canvas").getContext("2d");
                  ctx.font = `${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
                  const text = Math.max(...[...el.options].map(
                    (o) => ctx.measureText(o.text).width));
                  // padding, border and the drop-down arrow (about 20 px)
                  const room = el.clientWidth - parseFloat(s.paddingLeft)
                    - parseFloat(s.paddingRight) - 20;
                  return {name: el.name, text, room};
                }"""
            )
            assert fits["text"] <= fits["room"], fits
