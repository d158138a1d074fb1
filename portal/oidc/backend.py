"""The authentication backend of the provider's callback: code -> tokens -> claims
-> the account (by issuer and ``sub``) -> ``apply_identity`` (groups, staff, Unix account: the same
mapping as LDAP), at every sign-in.

mozilla-django-oidc does the protocol (token request with PKCE, the ID token's
signature against the provider's keys, nonce); this subclass takes its endpoints
from discovery when a callback arrives (never when a backend is built: Django builds
every backend for every password sign-in and every request's session, which must not
depend on the provider), keeps the refresh token of the answer, and hands the
verified claims to ``portal.oidc.accounts.sign_in`` (the account by issuer and
``sub``), which refuses with a message (``SignInRefused``) rather than returning
``None`` silently.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from mozilla_django_oidc.auth import (  # type: ignore[import-untyped]
    OIDCAuthenticationBackend,
)

from portal.oidc.accounts import SignInRefused, sign_in
from portal.oidc.discovery import Provider, provider

__all__ = ["OIDCBackend", "SignInRefused"]


class OIDCBackend(OIDCAuthenticationBackend):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.UserModel = get_user_model()

    def authenticate(self, request: Any, **kwargs: Any) -> Any:
        # Only the provider's callback carries a code and a state; a password
        # sign-in (username, password) is not ours.
        if request is None or "username" in kwargs or "password" in kwargs:
            return None
        if not request.GET.get("code") or not request.GET.get("state"):
            return None
        self.configure(provider())
        return super().authenticate(request, **kwargs)

    def configure(self, found: Provider) -> None:
        """Point the protocol at ``found``'s endpoints and this client's settings."""
        from django.conf import settings

        self.OIDC_OP_TOKEN_ENDPOINT = found.token_endpoint
        self.OIDC_OP_USER_ENDPOINT = found.userinfo_endpoint
        self.OIDC_OP_JWKS_ENDPOINT = found.jwks_uri
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None

    def signed_claims(self, id_token: str) -> dict[str, Any]:
        """The claims of an ID token whose signature is the provider's (after
        ``configure``). No nonce check: a refreshed ID token answers no request
        of ours that carried one (some providers copy the sign-in's)."""
        if self.OIDC_RP_SIGN_ALGO.startswith(("RS", "ES")):
            key = self.retrieve_matching_jwk(id_token.encode())
        else:
            key = self.OIDC_RP_CLIENT_SECRET
        payload: dict[str, Any] = self.get_payload_data(id_token.encode(), key)
        return payload

    def get_user(self, user_id: Any) -> Any:
        """The session's user, unless deactivated since (as Django's ModelBackend)."""
        user = self.UserModel._default_manager.filter(pk=user_id).first()
        return user if user is not None and self.user_can_authenticate(user) else None

    def get_userinfo(
        self, access_token: str, id_token: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        """The ID token's claims, completed by the userinfo endpoint's (providers
        put custom claims in one or the other)."""
        userinfo = super().get_userinfo(access_token, id_token, payload)
        if userinfo.get("sub") not in (None, payload.get("sub")):
            raise SignInRefused(
                "The identity provider's userinfo is about another subject than its"
                " ID token"
            )
        return {**payload, **userinfo}

    def get_token(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The token endpoint's answer, its refresh token kept for the sign-in."""
        answer: dict[str, Any] = super().get_token(payload)
        refresh = answer.get("refresh_token")
        self._refresh_token = refresh if isinstance(refresh, str) else ""
        return answer

    def get_or_create_user(
        self, access_token: str, id_token: str, payload: dict[str, Any]
    ) -> Any:
        claims = self.get_userinfo(access_token, id_token, payload)
        issuer = payload.get("iss") or provider().issuer
        return sign_in(claims, str(issuer), getattr(self, "_refresh_token", ""))
