"""``gpulab login`` through the browser, end to end on real processes: the
console script (run on a terminal, as a person runs it) asks the real stack
(uvicorn, PostgreSQL, Redis) for a code; Chromium, driven by Playwright, signs
in on the portal and approves it on the approval page; the CLI receives its
token, which then works for ``gpulab ls``, is listed on the Tokens page under
the machine's name, and once revoked there stops the CLI with a clear error.
A denied sign-in leaves the CLI without a token."""

from __future__ import annotations

import os
import pty
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.browser import chromium, collect_errors
from tests.e2e.conftest import Proc

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from playwright.sync_api import Page

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.web_only]

GPULAB = str(Path(sys.executable).parent / "gpulab")
WAIT_MS = 60_000


def cli_env(tmp_path: Path) -> dict[str, str]:
    """A login node's shell: no Django settings, its own config dir, no display
    (so no browser is started: the test's Chromium plays the user's)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO", "DATABASE", "REDIS", "GPULAB"))
        and k not in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER")
    }
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    env["COLUMNS"] = "160"
    return env


@dataclass
class Login:
    """A running ``gpulab login`` and the terminal it reads."""

    proc: Proc
    terminal: int  # the pty's other end, closed when it ends

    def shown_code(self) -> tuple[str, str]:
        """The code and the complete approval URL the CLI prints."""
        line = self.proc.wait_for(r"^To sign in, open \S+ and enter the code")
        code = line.rsplit(" ", 1)[1]
        url = self.proc.wait_for(r"^\(or open \S+\)")
        return code, url.removeprefix("(or open ").rstrip(")")

    def finished(self) -> int:
        try:
            return self.proc.popen.wait(timeout=60)
        finally:
            os.close(self.terminal)


def start_login(stack: Stack, env: dict[str, str], name: str) -> Login:
    """``gpulab --server URL login`` with a terminal on stdin (the default path:
    through the browser), its output collected line by line."""
    primary, secondary = pty.openpty()
    try:
        popen = subprocess.Popen(
            [GPULAB, "--server", stack.base_url, "login"],
            env=env,
            stdin=secondary,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
    finally:
        os.close(secondary)
    proc = Proc(name, popen)
    proc.start_reader()
    stack.procs[name] = proc  # stopped with the stack if the test fails
    return Login(proc, primary)


def gpulab(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GPULAB, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def sign_in_at(page: Page, url: str, base_url: str) -> None:
    """Follow the CLI's URL: the portal asks to sign in first, then comes back."""
    page.goto(url)
    assert page.url.startswith(f"{base_url}/accounts/login/"), page.url
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "pw-alice")
    page.click("button[type=submit], input[type=submit]")
    page.wait_for_url(re.compile(r".*/device/\?code=.*"))


def test_gpulab_login_through_the_browser(
    stack: Stack, alice: User, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    env = cli_env(tmp_path)
    machine = socket.gethostname()
    login = start_login(stack, env, "gpulab-login")
    code, url = login.shown_code()
    assert re.fullmatch(r"[B-Z]{4}-[B-Z]{4}", code)
    assert url == f"{stack.base_url}/device/?code={code}"
    login.proc.wait_for(r"Waiting for you to approve it there")

    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = collect_errors(page)
        sign_in_at(page, url, stack.base_url)
        # the page shows what the terminal shows: the machine and the code
        expect(page.get_by_test_id("device-machine")).to_have_text(machine)
        expect(page.get_by_test_id("device-code")).to_have_text(code)
        page.get_by_test_id("approve").click()
        expect(page.get_by_test_id("device-done")).to_contain_text("Approved")

        assert login.finished() == 0, login.proc.output()
        out = login.proc.output()
        assert f"Logged in to {stack.base_url} as alice (token {machine!r}" in out
        config = tmp_path / "config" / "gpulab" / "config.json"
        assert oct(config.stat().st_mode & 0o777) == "0o600"

        # The stored token works.
        listed = gpulab(env, "ls")
        assert listed.returncode == 0, listed.stderr
        who = gpulab(env, "whoami")
        assert who.returncode == 0 and f"token {machine!r}" in who.stdout

        # On the Tokens page under the machine's name, and revoked there.
        page.goto(f"{stack.base_url}/tokens/")
        row = page.get_by_test_id("tokens").locator("tr", has_text=machine)
        expect(row).to_contain_text("gpulab login from 127.0.0.1")
        expect(row).to_contain_text("active")
        row.get_by_role("button", name="Revoke").click()
        expect(page.get_by_role("status").first).to_contain_text("Token revoked")
        expect(row).to_contain_text("revoked")
        assert errors == []

    refused = gpulab(env, "ls")
    assert refused.returncode == 3, (refused.stdout, refused.stderr)
    assert "expired or revoked token" in refused.stderr
    assert "run 'gpulab login' to sign in again" in refused.stderr


def test_a_denied_login_stores_nothing(
    stack: Stack, alice: User, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    env = cli_env(tmp_path)
    login = start_login(stack, env, "gpulab-login-denied")
    code, url = login.shown_code()
    with chromium() as browser:
        page = browser.new_page()
        sign_in_at(page, url, stack.base_url)
        expect(page.get_by_test_id("device-code")).to_have_text(code)
        page.get_by_test_id("deny").click()
        expect(page.get_by_test_id("device-done")).to_contain_text("Denied")
    assert login.finished() == 3, login.proc.output()
    denied = "the sign-in was denied on the portal; nothing stored"
    assert denied in login.proc.output()
    assert not (tmp_path / "config" / "gpulab" / "config.json").exists()
