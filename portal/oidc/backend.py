"""The authentication backend of the provider's callback: code -> tokens -> claims
-> ``DirectoryIdentity`` -> ``apply_identity`` (groups, staff, Unix account: the same
mapping as LDAP), at every sign-in.

mozilla-django-oidc does the protocol (token request with PKCE, the ID token's
signature against the provider's keys, nonce); this subclass takes its endpoints
from discovery when a callback arrives (never when a backend is built: Django builds
every backend for every password sign-in and every request's session, which must not
depend on the provider), finds the user by the username claim, and refuses with a
message (``SignInRefused``) rather than returning ``None`` silently.
"""

from __future__ import annotations

import logging
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from mozilla_django_oidc.auth import (  # type: ignore[import-untyped]
    OIDCAuthenticationBackend,
)

from portal.directory.identity import IdentityRefused, apply_identity
from portal.oidc.claims import ClaimNames, identity_from_claims
from portal.oidc.discovery import provider

log = logging.getLogger(__name__)


class SignInRefused(Exception):
    """The provider signed the user in but gpulab will not; the message says why."""


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
        from django.conf import settings

        found = provider()
        self.OIDC_OP_TOKEN_ENDPOINT = found.token_endpoint
        self.OIDC_OP_USER_ENDPOINT = found.userinfo_endpoint
        self.OIDC_OP_JWKS_ENDPOINT = found.jwks_uri
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        return super().authenticate(request, **kwargs)

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

    def get_or_create_user(
        self, access_token: str, id_token: str, payload: dict[str, Any]
    ) -> Any:
        claims = self.get_userinfo(access_token, id_token, payload)
        identity = identity_from_claims(claims, ClaimNames.from_settings())
        with transaction.atomic():
            user = (
                self.UserModel.objects.select_for_update()
                .filter(username=identity.username)
                .first()
            )
            if user is not None and user.has_usable_password():
                # A local account (a password stored in gpulab) is not handed to
                # whoever the provider calls by that name: an admin makes its
                # password unusable first (docs/admin-guide.md).
                raise SignInRefused(
                    f"gpulab has a local account named {identity.username!r}: sign"
                    " in with its password, or ask an admin to hand it to the"
                    " identity provider"
                )
            if user is None:
                user = self.UserModel(username=identity.username)
                user.set_unusable_password()
            user.email = identity.email or user.email
            user.first_name = identity.first_name or user.first_name
            user.last_name = identity.last_name or user.last_name
            user.save()
            try:
                changes = apply_identity(user, identity)
            except ValidationError as exc:
                raise SignInRefused(
                    f"The account {identity.username!r} cannot be used: "
                    + "; ".join(exc.messages)
                ) from None
            except IdentityRefused as exc:
                # An account gpulab cannot use (uid 0, a uid without a gid):
                # rolled back with the account this sign-in would have made.
                raise SignInRefused(str(exc)) from None
        if changes:
            log.info("oidc sign-in of %s: %s", user.username, "; ".join(changes))
        user.refresh_from_db()
        if not user.is_active:
            raise SignInRefused(
                f"The account {identity.username!r} is disabled"
                + (" by the identity provider" if not identity.active else "")
            )
        return user
