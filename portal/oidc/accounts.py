"""Which gpulab account a provider's sign-in is: found by the ID token's issuer and
``sub`` (stable for one person), never by the username claim alone.

A first sign-in (no identity stored for that issuer and sub) names a new account
with the username claim. If an account of that name exists already it is taken
over only when it is the provider's to give: made by an OpenID Connect sign-in
(``Profile.directory`` "oidc") or handed over by an admin (``manage.py
oidc_handover``), with no password and no other subject linked to it. A local
account (a usable password), an LDAP one, an account of another subject and any
other hand-made account are refused with a message saying which and why: a
provider whose users choose or recycle usernames must not hand out someone else's
jobs, tokens and quota.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from portal.directory.identity import IdentityRefused, apply_identity
from portal.oidc import secrets
from portal.oidc.claims import ClaimError, ClaimNames, identity_from_claims
from portal.oidc.models import OidcIdentity
from scheduler.models import Profile

if TYPE_CHECKING:
    from django.contrib.auth.models import User

log = logging.getLogger(__name__)


class SignInRefused(Exception):
    """The provider signed the user in but gpulab will not; the message says why."""


def subject(claims: dict[str, Any]) -> str:
    """The ``sub`` claim, checked (required by OpenID Connect: at most 255 ASCII)."""
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub or len(sub) > 255 or not sub.isascii():
        raise ClaimError("sub", "is missing or not a subject identifier")
    return sub


def _refusal(user: User, username: str) -> str | None:
    """Why the existing account ``user`` is not the new subject's to take; None
    when it may be (see the module's docstring)."""
    if OidcIdentity.objects.filter(user=user).exists():
        return (
            f"gpulab's account {username!r} belongs to another identity at the"
            " provider (a different subject): ask an admin (manage.py oidc_handover)"
        )
    if user.has_usable_password():
        return (
            f"gpulab has a local account named {username!r}: sign in with its"
            " password, or ask an admin to hand it to the identity provider"
            " (manage.py oidc_handover)"
        )
    directory = Profile.objects.filter(user=user).values_list("directory", flat=True)
    source = directory.first() or ""
    if source == Profile.Directory.LDAP:
        return (
            f"gpulab's account {username!r} comes from the LDAP directory: sign in"
            " with the directory's password, or ask an admin to hand it to the"
            " identity provider (manage.py oidc_handover)"
        )
    if source != Profile.Directory.OIDC:
        return (
            f"gpulab has an account named {username!r} that the identity provider"
            " did not make: ask an admin to hand it over (manage.py oidc_handover)"
        )
    return None


def sign_in(claims: dict[str, Any], issuer: str, refresh_token: str = "") -> User:
    """The account of a verified sign-in, made or found and brought in step with
    ``claims`` (``apply_identity``); its refresh token kept (encrypted).

    ``SignInRefused`` / ``ClaimError`` with a message for the login page; nothing
    is changed then (one transaction).
    """
    user_model = get_user_model()
    sub = subject(claims)
    if not issuer or len(issuer) > 255:
        raise SignInRefused(
            f"The identity provider's issuer {issuer[:300]!r} is unusable"
        )
    identity = identity_from_claims(claims, ClaimNames.from_settings())
    now = timezone.now()
    with transaction.atomic():
        link = (
            OidcIdentity.objects.select_for_update()
            .filter(issuer=issuer, sub=sub)
            .first()
        )
        if link is not None:
            user = user_model.objects.select_for_update().get(pk=link.user_id)
            if user.get_username() != identity.username:
                # The account keeps its name (jobs, tokens and the audit log
                # refer to it); the provider renamed the person.
                log.info(
                    "oidc: %s signs in as %r at the provider (subject %s)",
                    user.get_username(),
                    identity.username,
                    sub,
                )
        else:
            named = (
                user_model.objects.select_for_update()
                .filter(username=identity.username)
                .first()
            )
            if named is not None:
                why = _refusal(named, identity.username)
                if why is not None:
                    raise SignInRefused(why)
                user = named
            else:
                user = user_model(username=identity.username)
                user.set_unusable_password()
                user.save()
            link = OidcIdentity(user=user, issuer=issuer, sub=sub)
            log.info("oidc: %s is subject %s at %s", identity.username, sub, issuer)
        link.signed_in_at = now
        if refresh_token:
            link.refresh_token = secrets.encrypt(refresh_token)
            link.refresh_error = ""
        link.save()
        try:
            changes = apply_identity(user, identity)
        except ValidationError as exc:
            raise SignInRefused(
                f"The account {identity.username!r} cannot be used: "
                + "; ".join(exc.messages)
            ) from None
        except IdentityRefused as exc:
            # An account gpulab cannot use (uid 0, a uid without a gid): rolled
            # back with the account this sign-in would have made.
            raise SignInRefused(str(exc)) from None
    if changes:
        log.info("oidc sign-in of %s: %s", user.get_username(), "; ".join(changes))
    user.refresh_from_db()
    if not user.is_active:
        raise SignInRefused(
            f"The account {user.get_username()!r} is disabled"
            + (" by the identity provider" if not identity.active else "")
        )
    return user


def hand_over(user: User) -> None:
    """Make ``user`` the provider's to take at the next sign-in with its name (an
    admin's decision, ``manage.py oidc_handover``): its password removed, any
    identity linked before forgotten, marked as an OpenID Connect account."""
    with transaction.atomic():
        user.set_unusable_password()
        user.save(update_fields=["password"])
        OidcIdentity.objects.filter(user=user).delete()
        profile, _ = Profile.objects.select_for_update().get_or_create(user=user)
        profile.directory = Profile.Directory.OIDC
        profile.save(update_fields=["directory"])
