"""The periodic refresh of OpenID Connect users (``GPULAB_OIDC_REFRESH_INTERVAL``):
each active user's stored refresh token is used at the provider's token endpoint,
and the answer decides.

- Refused (``invalid_grant``: the user was disabled or removed at the provider, or
  their tokens revoked there): ``deactivate_user``, as for a user gone from LDAP
  (sessions deleted, websockets closed, API and CLI tokens revoked, waiting jobs
  held, all audited). Signing in again through the provider brings them back.
- Answered: the new refresh token is stored (providers rotate them), and the claims
  (a refreshed ID token's, completed by the userinfo endpoint's, as at sign-in) go
  through ``apply_identity``: groups, staff and the Unix account follow the
  provider; an ``active`` claim false deactivates.
- The provider unreachable, slow or answering an error (5xx, a malformed answer,
  ``invalid_client``): the run stops with a warning naming the URL; nobody is
  deactivated and the next run tries again.

Each user is refreshed under a row lock taken with SKIP LOCKED, kept until the new
token is stored: two runs at once never spend the same refresh token twice (a
provider that rotates tokens would refuse the second use, which would read as a
removal). The lock also orders a refresh against a sign-in storing a new token.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.utils import timezone
from requests import RequestException

from portal.directory.identity import IdentityRefused, apply_identity, deactivate_user
from portal.oidc import secrets
from portal.oidc.backend import OIDCBackend
from portal.oidc.claims import ClaimError, ClaimNames, identity_from_claims
from portal.oidc.discovery import Provider, ProviderUnavailable, describe, provider
from portal.oidc.models import OidcIdentity
from scheduler.models import Profile

log = logging.getLogger(__name__)

REFUSED = "signed out by the identity provider (it refused the refresh token: {})"


class ProviderDown(Exception):
    """The provider cannot answer now (the message names the URL): the run stops
    and nobody is deactivated."""


def refresh_oidc_users() -> dict[str, int]:
    """Refresh every active OpenID Connect user (``Profile.directory`` "oidc") who
    has a refresh token; counts of ``checked``, ``changed``, ``deactivated``,
    ``busy`` (being refreshed by another run), ``failed`` (left as they were,
    logged)."""
    counts = {"checked": 0, "changed": 0, "deactivated": 0, "busy": 0, "failed": 0}
    ids = list(
        # Only accounts kept in step with the provider now: one that signed in
        # through LDAP since follows LDAP's refresh.
        OidcIdentity.objects.filter(
            user__is_active=True, user__gpulab__directory=Profile.Directory.OIDC
        )
        .exclude(refresh_token="")
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    if not ids:
        return counts
    try:
        found = provider()
    except ProviderUnavailable as exc:
        log.warning("oidc refresh skipped, nobody deactivated: %s", exc)
        return counts
    backend = OIDCBackend()
    backend.configure(found)
    for pk in ids:
        try:
            outcome = _refresh_one(pk, found, backend)
        except ProviderDown as exc:
            log.warning(
                "oidc refresh stopped, nobody deactivated (next run tries again): %s",
                exc,
            )
            break
        if outcome != "busy":
            counts["checked"] += 1
        if outcome != "unchanged":
            counts[outcome] += 1
    log.info("oidc refresh: %s", counts)
    return counts


def _refresh_one(pk: int, found: Provider, backend: OIDCBackend) -> str:
    """One user: ``unchanged``, ``changed``, ``deactivated``, ``busy`` or
    ``failed``; ``ProviderDown`` raised after the lock is released (a rotated
    token stored first)."""
    down: ProviderDown | None = None
    with transaction.atomic():
        link = (
            OidcIdentity.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("user")
            .filter(pk=pk, user__is_active=True)
            .exclude(refresh_token="")
            .first()
        )
        if link is None:
            # Another run holds it (or it was deactivated / signed in meanwhile).
            return "busy"
        user = link.user
        try:
            token = secrets.decrypt(link.refresh_token)
        except secrets.UnreadableToken as exc:
            log.error("oidc refresh: %s left as they are: %s", user.username, exc)
            link.refresh_error = str(exc)
            link.save(update_fields=["refresh_error"])
            return "failed"
        answer = _token(found.token_endpoint, token)
        now = timezone.now()
        if "error" in answer:
            reason = REFUSED.format(answer["error"])
            link.refresh_token = ""
            link.refresh_error = f"{found.token_endpoint}: {answer['error']}"
            link.refreshed_at = now
            link.save(update_fields=["refresh_token", "refresh_error", "refreshed_at"])
            deactivate_user(user, reason)
            return "deactivated"
        # Stored whatever follows: a rotating provider has spent the old one.
        new_token = answer.get("refresh_token")
        if isinstance(new_token, str) and new_token:
            link.refresh_token = secrets.encrypt(new_token)
        link.refreshed_at = now
        link.refresh_error = ""
        link.save(update_fields=["refresh_token", "refreshed_at", "refresh_error"])
        try:
            with transaction.atomic():
                claims = _claims(found, backend, link, answer)
                identity = identity_from_claims(claims, ClaimNames.from_settings())
                changes = apply_identity(user, identity)
        except ProviderDown as exc:
            down = exc
        except (ClaimError, IdentityRefused, SuspiciousOperation) as exc:
            log.error("oidc refresh: %s left as they are: %s", user.username, exc)
            link.refresh_error = str(exc)
            link.save(update_fields=["refresh_error"])
            return "failed"
        except Exception as exc:
            # Anything else (a token the JWT library refuses, a database error in
            # the savepoint): logged, and the new refresh token still committed,
            # since the provider has spent the old one.
            log.exception("oidc refresh: %s left as they are", user.username)
            link.refresh_error = f"{type(exc).__name__}: {exc}"[:1000]
            link.save(update_fields=["refresh_error"])
            return "failed"
    if down is not None:
        raise down
    user.refresh_from_db(fields=["is_active"])
    if not user.is_active:
        return "deactivated"
    return "changed" if changes else "unchanged"


def _post(url: str, data: dict[str, str]) -> httpx.Response:
    try:
        return httpx.post(
            url,
            data=data,
            timeout=float(settings.OIDC_TIMEOUT),
            verify=bool(settings.OIDC_VERIFY_SSL),
            headers={"Accept": "application/json"},
        )
    except httpx.HTTPError as exc:
        raise ProviderDown(f"{url} cannot be reached: {describe(exc)}") from exc


def _token(url: str, refresh_token: str) -> dict[str, Any]:
    """The token endpoint's answer to the refresh, or ``{"error": ...}`` when it
    refused this user's grant; ``ProviderDown`` for anything else."""
    response = _post(
        url,
        {
            "grant_type": "refresh_token",
            "refresh_token": refresh_token,
            "client_id": settings.OIDC_RP_CLIENT_ID,
            "client_secret": settings.OIDC_RP_CLIENT_SECRET,
        },
    )
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ProviderDown(
            f"{url} answered HTTP {response.status_code} with no JSON object"
        )
    if response.status_code in (400, 401) and body.get("error") == "invalid_grant":
        # RFC 6749 5.2: the refresh token is invalid, expired or revoked.
        return {"error": "invalid_grant"}
    if response.status_code != 200:
        # invalid_client and the like are gpulab's configuration, not the user's.
        raise ProviderDown(
            f"{url} answered HTTP {response.status_code}"
            f" {str(body.get('error', ''))[:100]}".rstrip()
        )
    if not isinstance(body.get("access_token"), str):
        raise ProviderDown(f"{url} answered without an access_token")
    return body


def _claims(
    found: Provider, backend: OIDCBackend, link: OidcIdentity, answer: dict[str, Any]
) -> dict[str, Any]:
    """The refreshed ID token's claims (when the answer has one) completed by the
    userinfo endpoint's, both about the stored subject."""
    claims: dict[str, Any] = {}
    id_token = answer.get("id_token")
    if isinstance(id_token, str) and id_token:
        try:
            claims = backend.signed_claims(id_token)
        except RequestException as exc:
            raise ProviderDown(f"{found.jwks_uri} cannot be used: {exc}") from exc
        if claims.get("iss") not in (None, link.issuer):
            raise SuspiciousOperation(
                f"the refreshed ID token's issuer is {claims.get('iss')!r},"
                f" not {link.issuer!r}"
            )
    try:
        response = httpx.get(
            found.userinfo_endpoint,
            headers={"Authorization": f"Bearer {answer['access_token']}"},
            timeout=float(settings.OIDC_TIMEOUT),
            verify=bool(settings.OIDC_VERIFY_SSL),
        )
    except httpx.HTTPError as exc:
        raise ProviderDown(
            f"{found.userinfo_endpoint} cannot be reached: {describe(exc)}"
        ) from exc
    if response.status_code != 200:
        raise ProviderDown(
            f"{found.userinfo_endpoint} answered HTTP {response.status_code}"
        )
    if response.headers.get("content-type", "").startswith("application/jwt"):
        userinfo = backend.signed_claims(response.text)
    else:
        try:
            userinfo = response.json()
        except ValueError:
            userinfo = None
    if not isinstance(userinfo, dict):
        raise ProviderDown(f"{found.userinfo_endpoint} answered no JSON object")
    for source in (claims, userinfo):
        if source.get("sub", link.sub) != link.sub:
            raise SuspiciousOperation(
                f"the provider answered about subject {source.get('sub')!r}, not"
                f" {link.sub!r}"
            )
    return {**claims, **userinfo}
