"""API authentication: a personal token (``Authorization: Bearer gpl_...``) or the
browser's session (DRF's, which enforces CSRF on unsafe methods).

A token is looked up by its SHA-256 hash; revoked, expired or unknown tokens get
401 with one message that does not say which (no oracle). The token itself is
never logged or stored."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db.models import Q
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from portal.api.models import LAST_USED_EVERY, TOKEN_PREFIX, ApiToken
from scheduler.models import hash_token

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from rest_framework.request import Request

BAD_TOKEN = "Invalid, expired or revoked token; create a new one on the Tokens page."


class TokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <token>`` (``Token <token>`` is accepted too)."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[User, ApiToken] | None:
        header = authentication.get_authorization_header(request).split()
        if not header:
            return None
        if header[0].lower() not in (b"bearer", b"token"):
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed(
                "Write the header as 'Authorization: Bearer <token>'."
            )
        try:
            token = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed(BAD_TOKEN) from None
        found = user_for_token(token)
        if found is None:
            raise exceptions.AuthenticationFailed(BAD_TOKEN)
        return found

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


def user_for_token(token: str) -> tuple[User, ApiToken] | None:
    """The active user a usable token ``token`` belongs to, and its row; None for
    an unknown, revoked or expired one, or an inactive user's. Stamps the
    token's ``last_used_at`` (at most once a minute). The API's and the terminal
    websocket's (``portal.terminal``) one check."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 100:
        return None
    now = timezone.now()
    row = (
        ApiToken.objects.usable(now)
        .select_related("user")
        .filter(token_hash=hash_token(token))
        .first()
    )
    if row is None or not row.user.is_active:
        return None
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_EVERY:
        # At most one write a minute per token, whatever the request rate.
        ApiToken.objects.filter(pk=row.pk).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_EVERY)
        ).update(last_used_at=now)
    return row.user, row


class SessionAuthentication(authentication.SessionAuthentication):
    """The browser's session; CSRF checked on unsafe methods (DRF's rule)."""


class TokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """The token in the OpenAPI schema: HTTP bearer."""

    target_class = "portal.api.auth.TokenAuthentication"
    name = "token"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A personal API token (Tokens page): gpl_...",
        }


class SessionScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """The browser's session cookie (unsafe methods also need the CSRF token)."""

    target_class = "portal.api.auth.SessionAuthentication"
    name = "session"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "apiKey", "in": "cookie", "name": "sessionid"}
