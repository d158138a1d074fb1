"""Playwright driving Debian's Chromium (``make test`` and ``.ci/run`` install it).

Never a browser download, never a skip: without Chromium these tests fail with
Playwright's error naming the missing executable.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from playwright.sync_api import Browser, Page

T = TypeVar("T")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root (CI) Chromium needs --no-sandbox; there is no GPU to draw with.
ARGS = ["--no-sandbox", "--disable-gpu"]


@contextmanager
def chromium() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def collect_errors(page: Page) -> list[str]:
    """Uncaught script errors of the page, to assert there were none."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def log_in(page: Page, base_url: str, username: str, password: str) -> None:
    """Through the login form, as a person would."""
    page.goto(f"{base_url}/accounts/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit], input[type=submit]")
    page.wait_for_url(f"{base_url}/")


def outside_the_loop(fn: Callable[[], T]) -> T:
    """Run database code from inside a Playwright block: its sync API keeps an
    event loop running in this thread, where Django refuses the ORM."""
    from django.db import connections

    def run() -> T:
        try:
            return fn()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()
