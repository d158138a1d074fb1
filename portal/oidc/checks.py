"""A deployment check (``manage.py check``, run by ``migrate`` and so by ``make
up``): the periodic refresh reads a refused refresh token as the user's removal,
so a provider asked without ``offline_access`` (whose refresh tokens end with the
browser session there) would sign everyone out when that session ends."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks


@checks.register(checks.Tags.security)
def offline_access_asked(**_: Any) -> list[checks.CheckMessage]:
    if not settings.GPULAB_OIDC_ENABLED:
        return []
    if "offline_access" in settings.OIDC_RP_SCOPES.split():
        return []
    return [
        checks.Warning(
            f"GPULAB_OIDC_SCOPES={settings.OIDC_RP_SCOPES!r} does not ask for"
            " offline_access: the provider's refresh tokens may end with the"
            " user's browser session there, and the periodic refresh treats a"
            " refused token as the user's removal (signed out, tokens revoked).",
            hint="Add offline_access to GPULAB_OIDC_SCOPES (and allow it for the"
            " client at the provider); see docs/admin-guide.md, OpenID Connect.",
            id="gpulab.W001",
        )
    ]
