"""The OpenID Connect refresh against the real provider (django-oidc-provider in its
own process): a user signed in through the browser is kept in step without signing
in again. Her groups and Unix account changed at the provider reach gpulab at the
next refresh; two refreshes at once spend her rotating refresh token once; disabled
at the provider (her tokens revoked there), the next refresh ends her session,
revokes her API token, holds her waiting job and writes it all to the audit log."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser import chromium, outside_the_loop
from tests.e2e.conftest import ROOT
from tests.oidc.conftest import lab_user
from tests.oidc.test_flow_browser import WAIT_MS, account, sign_in_at_provider
from tests.oidc.test_refresh_browser import after, sessions_of, token_and_waiting_job

if TYPE_CHECKING:
    from tests.e2e.conftest import Stack
    from tests.oidc.conftest import Provider

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def start_refresh(stack: Stack) -> subprocess.Popen[str]:
    """``manage.py oidc_refresh`` with the portal's settings (what beat runs)."""
    return subprocess.Popen(
        [sys.executable, "manage.py", "oidc_refresh"],
        cwd=ROOT,
        env=stack.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(run: subprocess.Popen[str]) -> dict[str, int]:
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, out + err
    counts: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return counts


def refresh(stack: Stack) -> dict[str, int]:
    return finish(start_refresh(stack))


def audit_of(username: str) -> list[dict[str, Any]]:
    from django.contrib.auth.models import User

    from portal.quotas.models import AuditEntry

    def read() -> list[dict[str, Any]]:
        pk = str(User.objects.get(username=username).pk)
        return [
            {"via": e.via, **(e.new or {})}
            for e in AuditEntry.objects.filter(object_id=pk).order_by("pk")
        ]

    return outside_the_loop(read)


def test_the_refresh_follows_the_provider_and_signs_out_a_disabled_user(
    oidc_env: dict[str, str], stack: Stack, provider: Provider
) -> None:
    provider.seed([lab_user("fay")], redirect_base=stack.base_url)
    with chromium() as browser:
        page = browser.new_context().new_page()
        sign_in_at_provider(page, stack, provider, "fay")
        page.wait_for_url(f"{stack.base_url}/", timeout=WAIT_MS)
        assert account("fay")["groups"] == {"vision": False}
        token_id, job_id = token_and_waiting_job("fay")

        # Nothing changed at the provider: nothing changes here.
        assert refresh(stack) == {
            "busy": 0, "changed": 0, "checked": 1, "deactivated": 0, "failed": 0,
        }  # fmt: skip

        # Moved to another lab at the provider; two refreshes at once: the
        # provider rotates refresh tokens, so a second use of one would be
        # refused (and read as a removal) but for the row lock.
        provider.seed(
            [
                lab_user(
                    "fay",
                    groups=["nlp-lab", "lab-admins"],
                    uid=20002,
                    gid=20002,
                    gids=[20002, 3001],
                )
            ]
        )
        runs = [start_refresh(stack), start_refresh(stack)]
        counts = [finish(run) for run in runs]
        assert sum(c["changed"] for c in counts) == 1, counts
        assert sum(c["deactivated"] for c in counts) == 0, counts
        assert account("fay")["groups"] == {"nlp": False}
        assert account("fay")["staff"] is True
        assert account("fay")["unix"] == ("fay", 20002, 20002, [3001])
        assert account("fay")["active"] is True
        assert sessions_of("fay") == 1
        page.goto(f"{stack.base_url}/")
        assert page.url == f"{stack.base_url}/"

        # Disabled at the provider (Keycloak revokes her tokens with it).
        provider.seed([{**lab_user("fay"), "active": False}])
        assert refresh(stack)["deactivated"] == 1
        assert account("fay")["active"] is False
        assert sessions_of("fay") == 0
        assert after(token_id, job_id) == {"revoked": True, "job": "held"}
        page.goto(f"{stack.base_url}/")
        page.wait_for_url(re.compile(re.escape(stack.base_url) + "/accounts/login/"))
    entries = audit_of("fay")
    assert entries[-1]["via"] == "oidc"
    assert entries[-1]["is_active"] is False
    assert "refused the refresh token: invalid_grant" in entries[-1]["reason"]
    assert entries[-1]["tokens_revoked"] == 1
    assert entries[-1]["jobs_held"] == [job_id]
    assert any("nlp" in e.get("groups", {}) for e in entries)
    # Nothing left to refresh until she signs in again.
    assert refresh(stack)["checked"] == 0
