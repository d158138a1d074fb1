"""Each OpenID Connect sign-in refreshes the account from the claims: a user the
provider marks inactive (GPULAB_OIDC_ACTIVE_CLAIM) is refused and deactivated
(``deactivate_user``: their other sessions end, tokens are revoked, waiting jobs
held); active again, they sign in, in the groups the claims now say."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser import chromium, outside_the_loop
from tests.oidc.conftest import lab_user
from tests.oidc.test_flow_browser import WAIT_MS, account, sign_in_at_provider

if TYPE_CHECKING:
    from tests.e2e.conftest import Stack
    from tests.oidc.conftest import Provider

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def token_and_waiting_job(username: str) -> tuple[int, int]:
    from django.contrib.auth.models import User

    from portal.api.tokens import create_token
    from scheduler import services
    from tests.conftest import make_node

    def make() -> tuple[int, int]:
        user = User.objects.get(username=username)
        token, _ = create_token(user, "laptop", 30)
        # A drained node: the job waits.
        node, _ = make_node("drained-node", 1)
        services.set_node_mode(node.pk, "drain", by=None)
        request = services.JobRequest(name="waits", command="true", workdir="/tmp")
        return token.pk, services.submit_job(user, request).pk

    return outside_the_loop(make)


def after(token_id: int, job_id: int) -> dict[str, Any]:
    from portal.api.models import ApiToken
    from scheduler.models import Job

    def read() -> dict[str, Any]:
        return {
            "revoked": ApiToken.objects.get(pk=token_id).revoked_at is not None,
            "job": Job.objects.get(pk=job_id).status,
        }

    return outside_the_loop(read)


def sessions_of(username: str) -> int:
    from django.contrib.auth.models import User
    from django.contrib.sessions.models import Session

    def count() -> int:
        pk = str(User.objects.get(username=username).pk)
        return sum(
            1
            for s in Session.objects.all()
            if s.get_decoded().get("_auth_user_id") == pk
        )

    return outside_the_loop(count)


def test_inactive_at_the_provider_is_deactivated_and_refused_then_restored(
    oidc_env: dict[str, str], stack: Stack, provider: Provider
) -> None:
    provider.seed([lab_user("eve")], redirect_base=stack.base_url)
    with chromium() as browser:
        first = browser.new_context().new_page()
        sign_in_at_provider(first, stack, provider, "eve")
        first.wait_for_url(f"{stack.base_url}/", timeout=WAIT_MS)
        token_id, job_id = token_and_waiting_job("eve")
        assert after(token_id, job_id) == {"revoked": False, "job": "pending"}

        provider.seed([lab_user("eve", active=False)])
        second = browser.new_context().new_page()
        sign_in_at_provider(second, stack, provider, "eve")
        second.wait_for_url(f"{stack.base_url}/accounts/login/", timeout=WAIT_MS)
        assert "The account 'eve' is disabled by the identity provider" in (
            second.inner_text("main")
        )
        assert account("eve")["active"] is False
        assert after(token_id, job_id) == {"revoked": True, "job": "held"}
        assert sessions_of("eve") == 0
        # The session opened before is gone too.
        first.goto(f"{stack.base_url}/")
        first.wait_for_url(re.compile(re.escape(stack.base_url) + "/accounts/login/"))

        # Active again, and moved to another lab by the provider.
        provider.seed([lab_user("eve", groups=["nlp-lab"])])
        # (Seeding set her password again, which ends her provider session.)
        sign_in_at_provider(second, stack, provider, "eve")
        second.wait_for_url(f"{stack.base_url}/", timeout=WAIT_MS)
    assert account("eve")["active"] is True
    assert account("eve")["groups"] == {"nlp": False}
