"""The whole OpenID Connect sign-in in a real browser against a real provider
process: the login page's button, the provider's own login page and consent, the
callback, the user landing on the cluster page in the group, staff flag and Unix
account the claims say; signing out ends the provider's session too. A provider
that refuses (consent declined), sends an unusable claim, or names a local account
ends on the login page with a message naming why, never an error page."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser import chromium, collect_errors, outside_the_loop
from tests.oidc.conftest import lab_user

if TYPE_CHECKING:
    from playwright.sync_api import Page

    from tests.e2e.conftest import Stack
    from tests.oidc.conftest import Provider

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.web_only]

WAIT_MS = 60_000


def sign_in_at_provider(
    page: Page,
    stack: Stack,
    provider: Provider,
    username: str,
    *,
    consent: bool = True,
    signed_in: bool = False,
    start: str = "/accounts/login/",
) -> None:
    """From the portal's ``start`` page through the provider's pages (its login
    page unless the browser is ``signed_in`` there already)."""
    page.goto(f"{stack.base_url}{start}")
    page.click("#oidc-sign-in")
    if not signed_in:
        page.wait_for_url(re.compile(re.escape(provider.base_url) + "/accounts/login/"))
        assert "Lab single sign-on" in page.content()
        page.fill("input[name=username]", username)
        page.fill("input[name=password]", f"pw-{username}")
        page.click("#sso-login")
    page.wait_for_url(re.compile(re.escape(provider.issuer) + "/authorize"))
    assert "Request for Permission" in page.content()
    page.click("input[name=allow]" if consent else "input[value=Decline]")


def account(username: str) -> dict[str, Any]:
    from django.contrib.auth.models import User

    from scheduler.models import Membership

    def read() -> dict[str, Any]:
        user = User.objects.select_related("gpulab").get(username=username)
        return {
            "active": user.is_active,
            "staff": user.is_staff,
            "usable_password": user.has_usable_password(),
            "email": user.email,
            "groups": {
                m.group.name: m.is_leader
                for m in Membership.objects.filter(user=user).select_related("group")
            },
            "unix": (
                user.gpulab.unix_account,
                user.gpulab.unix_uid,
                user.gpulab.unix_gid,
                list(user.gpulab.unix_gids),
            ),
        }

    return outside_the_loop(read)


def test_sign_in_lands_on_the_cluster_page_in_the_claimed_group(
    oidc_env: dict[str, str], stack: Stack, provider: Provider
) -> None:
    provider.seed(
        [
            lab_user("ada"),
            lab_user("grace", groups=["vision-lab", "vision-pis", "lab-admins"]),
        ],
        redirect_base=stack.base_url,
    )
    with chromium() as browser:
        page = browser.new_page()
        errors = collect_errors(page)
        page.goto(f"{stack.base_url}/accounts/login/")
        assert page.inner_text("#oidc-sign-in") == "Sign in with Lab SSO"

        sign_in_at_provider(page, stack, provider, "ada")
        page.wait_for_url(f"{stack.base_url}/", timeout=WAIT_MS)
        assert page.inner_text("header .who").find("ada") >= 0
        assert errors == []
        assert account("ada") == {
            "active": True,
            "staff": False,
            "usable_password": False,
            "email": "ada@lab.example.org",
            "groups": {"vision": False},
            "unix": ("ada", 20001, 20001, [3000]),
        }

        # Signing out ends the portal's session and the provider's: the next
        # sign-in asks for the password again.
        page.click("header .who button")
        page.wait_for_url(f"{stack.base_url}/accounts/login/", timeout=WAIT_MS)
        page.goto(f"{stack.base_url}/")
        page.wait_for_url(re.compile(re.escape(stack.base_url) + "/accounts/login/"))
        page.click("#oidc-sign-in")
        page.wait_for_url(re.compile(re.escape(provider.base_url) + "/accounts/login/"))

    with chromium() as browser:
        page = browser.new_page()
        # From a page that asked for a sign-in: back there afterwards.
        sign_in_at_provider(page, stack, provider, "grace", start="/usage/")
        page.wait_for_url(f"{stack.base_url}/usage/", timeout=WAIT_MS)
        # Staff: the header links to the admin console.
        assert page.locator("header nav a", has_text="Admin").count() == 1
    assert account("grace")["groups"] == {"vision": True}
    assert account("grace")["staff"] is True


def test_a_refused_sign_in_ends_on_the_login_page_naming_why(
    oidc_env: dict[str, str], stack: Stack, provider: Provider
) -> None:
    provider.seed(
        [
            lab_user("linus", uid="twenty"),
            lab_user("ken", groups=...),
            lab_user("dennis"),
        ],
        redirect_base=stack.base_url,
    )
    from django.contrib.auth.models import User

    # A local account of the same name is not handed to the provider's user.
    outside_the_loop(
        lambda: User.objects.create_user("dennis", password="local-password")
    )
    with chromium() as browser:
        page = browser.new_page()
        sign_in_at_provider(page, stack, provider, "dennis")
        page.wait_for_url(f"{stack.base_url}/accounts/login/", timeout=WAIT_MS)
        assert "gpulab has a local account named 'dennis'" in page.inner_text("main")

    with chromium() as browser:
        page = browser.new_page()
        sign_in_at_provider(page, stack, provider, "linus")
        page.wait_for_url(f"{stack.base_url}/accounts/login/", timeout=WAIT_MS)
        assert "claim 'uid' is 'twenty', not a number" in page.inner_text("main")

    with chromium() as browser:
        page = browser.new_page()
        # Declining consent at the provider: its error, shown on the login page.
        sign_in_at_provider(page, stack, provider, "ken", consent=False)
        page.wait_for_url(
            re.compile(re.escape(stack.base_url) + "/accounts/login/"), timeout=WAIT_MS
        )
        assert "The identity provider refused the sign-in" in page.inner_text("main")

        sign_in_at_provider(page, stack, provider, "ken", signed_in=True)
        page.wait_for_url(f"{stack.base_url}/accounts/login/", timeout=WAIT_MS)
        assert "claim 'groups' is missing" in page.inner_text("main")

    assert not outside_the_loop(
        lambda: User.objects.filter(username__in=["linus", "ken"]).exists()
    )
    assert "Traceback" not in stack.procs["web"].output(400)
