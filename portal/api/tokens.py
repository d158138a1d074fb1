"""The verbs on personal API tokens (the only writers of ``ApiToken`` and
``DeviceAuthorization``): create (the secret returned once, only its hash kept)
and revoke; and ``gpulab login`` through the browser (RFC 8628's device
authorization grant): start one, look up its user code, approve or deny it,
redeem its device code for a token once."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from ipaddress import ip_address
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.api.models import (
    USER_CODE_ALPHABET,
    USER_CODE_LENGTH,
    ApiToken,
    DeviceAuthorization,
)
from scheduler.models import hash_token

if TYPE_CHECKING:
    from django.contrib.auth.models import User

MAX_DAYS = 3650
MAX_TOKENS = 50


def create_token(user: User, name: str, days: int | None) -> tuple[ApiToken, str]:
    """A new token of ``user`` named ``name``, expiring after ``days`` (None or
    0: never); returns the row and the secret, which is never stored."""
    name = name.strip()
    errors: dict[str, str] = {}
    if not name:
        errors["name"] = "Name the token (where it is used, e.g. 'laptop')."
    elif len(name) > 100 or "\x00" in name:
        errors["name"] = "At most 100 characters, no NUL."
    if days is not None and not 0 <= days <= MAX_DAYS:
        errors["days"] = f"Between 0 (never expires) and {MAX_DAYS} days."
    if errors:
        raise ValidationError(errors)
    secret = ApiToken.new_secret()
    now = timezone.now()
    token = ApiToken(
        user=user,
        name=name,
        created_at=now,
        expires_at=now + timedelta(days=days) if days else None,
    )
    token.set_secret(secret)
    with transaction.atomic():
        if ApiToken.objects.usable(now).filter(user=user).count() >= MAX_TOKENS:
            raise ValidationError(
                {"name": f"You have {MAX_TOKENS} active tokens; revoke one first."}
            )
        token.save()
    return token, secret


def revoke_token(user: User, token_id: int) -> bool:
    """Revoke one of ``user``'s tokens; False if it is not theirs or was already
    revoked (a compare-and-swap: two revokes at once revoke it once)."""
    return bool(
        ApiToken.objects.filter(pk=token_id, user=user, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
    )


# ------------------------------------------------------------------ device login

# A slow_down adds this to the poll interval (RFC 8628 3.5).
SLOW_DOWN_S = 5
# Finished or expired authorizations that issued no token are deleted this long
# after they expired (the issued ones stay: the Tokens page says where a token
# came from).
KEEP_EXPIRED = timedelta(days=1)
CODE_HELP = "A code is 8 letters, like BCDF-GHJK (the dash is optional)."


def _check_name(name: str, field: str) -> str:
    name = name.strip()
    if not name:
        raise ValidationError({field: "Name the machine (e.g. its host name)."})
    if len(name) > 100 or not name.isprintable():
        raise ValidationError({field: "At most 100 printable characters."})
    return name


def _address(raw: str | None) -> str | None:
    try:
        return str(ip_address((raw or "").strip()))
    except ValueError:
        return None


def start_device_login(
    client_name: str, address: str | None, now: datetime | None = None
) -> tuple[DeviceAuthorization, str]:
    """A new pending authorization for the machine ``client_name`` asking from
    ``address``; returns the row and the device code, which is never stored
    (only its hash). The user code is drawn again on the rare collision."""
    name = _check_name(client_name, "client_name")
    now = now or timezone.now()
    DeviceAuthorization.objects.filter(expires_at__lt=now - KEEP_EXPIRED).exclude(
        status=DeviceAuthorization.Status.ISSUED
    ).delete()
    device_code = secrets.token_urlsafe(32)
    for attempt in range(5):
        row = DeviceAuthorization(
            device_code_hash=hash_token(device_code),
            user_code="".join(
                secrets.choice(USER_CODE_ALPHABET) for _ in range(USER_CODE_LENGTH)
            ),
            client_name=name,
            client_address=_address(address),
            created_at=now,
            expires_at=now + timedelta(seconds=settings.GPULAB_DEVICE_CODE_TTL),
            interval=settings.GPULAB_DEVICE_POLL_INTERVAL,
        )
        try:
            with transaction.atomic():
                row.save()
        except IntegrityError:
            if attempt == 4:
                raise
            continue
        break
    return row, device_code


def normalise_user_code(raw: str) -> str:
    """``bcdf-ghjk``, ``BCDF GHJK``, ``BCDFGHJK`` -> ``BCDFGHJK``; a
    ``ValidationError`` on ``code`` for anything else."""
    code = "".join(raw.split()).replace("-", "").upper()
    if len(code) != USER_CODE_LENGTH or any(c not in USER_CODE_ALPHABET for c in code):
        raise ValidationError({"code": CODE_HELP})
    return code


def pending_device_login(
    user_code: str, now: datetime | None = None
) -> DeviceAuthorization | None:
    """The pending, unexpired authorization of ``user_code`` (normalised), if any."""
    return DeviceAuthorization.objects.filter(
        user_code=user_code,
        status=DeviceAuthorization.Status.PENDING,
        expires_at__gt=now or timezone.now(),
    ).first()


def decide_device_login(
    user: User, user_code: str, *, approve: bool
) -> DeviceAuthorization:
    """``user`` approves (the CLI's next poll gets a token of theirs) or denies
    the pending authorization of ``user_code``: a compare-and-swap, so one
    decision wins. A ``ValidationError`` on ``code`` if it is not pending any
    more (expired, used, decided) or unknown; on approval, also if the user has
    as many active tokens as allowed."""
    now = timezone.now()
    gone = ValidationError(
        {
            "code": "No sign-in waits with this code: it expired, was used, or was "
            "mistyped. Run gpulab login again for a new one."
        }
    )
    if approve and ApiToken.objects.usable(now).filter(user=user).count() >= MAX_TOKENS:
        raise ValidationError(
            {"code": f"You have {MAX_TOKENS} active tokens; revoke one first."}
        )
    status = (
        DeviceAuthorization.Status.APPROVED
        if approve
        else DeviceAuthorization.Status.DENIED
    )
    done = DeviceAuthorization.objects.filter(
        user_code=user_code,
        status=DeviceAuthorization.Status.PENDING,
        expires_at__gt=now,
    ).update(status=status, user=user, decided_at=now)
    if not done:
        raise gone
    return DeviceAuthorization.objects.get(user_code=user_code)


class DeviceGrantError(Exception):
    """A poll answered without a token: ``code`` is RFC 8628 3.5's
    (authorization_pending, slow_down, access_denied, expired_token) or RFC
    6749's invalid_grant (unknown or already used); ``detail`` a sentence."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class Issued:
    token: ApiToken
    secret: str


def redeem_device_code(device_code: str, now: datetime | None = None) -> Issued:
    """The token for an approved authorization, issued once: the row is locked,
    so of two polls at once one gets the token and the other invalid_grant.
    Otherwise a ``DeviceGrantError``; a pending one records the poll, and a poll
    sooner than its interval is answered slow_down and lengthens it."""
    now = now or timezone.now()
    outcome: Issued | DeviceGrantError
    with transaction.atomic():
        row = (
            DeviceAuthorization.objects.select_for_update()
            .filter(device_code_hash=hash_token(device_code))
            .first()
        )
        outcome = _redeem(row, now)
    if isinstance(outcome, DeviceGrantError):
        raise outcome
    return outcome


def _redeem(
    row: DeviceAuthorization | None, now: datetime
) -> Issued | DeviceGrantError:
    """``redeem_device_code``'s decision, in its transaction (with the row
    locked): its writes are kept whatever the answer."""
    s = DeviceAuthorization.Status
    if row is None:
        return DeviceGrantError(
            "invalid_grant", "Unknown device code; run gpulab login again."
        )
    if row.status == s.ISSUED:
        return DeviceGrantError(
            "invalid_grant", "This code was already used; run gpulab login again."
        )
    if row.status == s.DENIED:
        return DeviceGrantError(
            "access_denied", "The sign-in was denied on the portal."
        )
    if row.expires_at <= now:
        return DeviceGrantError(
            "expired_token",
            "The code expired before it was approved; run gpulab login again.",
        )
    if row.status == s.PENDING:
        too_soon = (
            row.last_polled_at is not None
            and now - row.last_polled_at < timedelta(seconds=row.interval)
        )
        row.last_polled_at = now
        if too_soon:
            row.interval += SLOW_DOWN_S
            row.save(update_fields=["last_polled_at", "interval"])
            return DeviceGrantError(
                "slow_down", f"Polled too often; wait {row.interval} s between polls."
            )
        row.save(update_fields=["last_polled_at"])
        return DeviceGrantError(
            "authorization_pending", "Waiting for the user to approve the code."
        )
    user = row.user
    if user is None or not user.is_active:
        row.status = s.DENIED
        row.save(update_fields=["status"])
        return DeviceGrantError("access_denied", "The approving account is disabled.")
    try:
        token, secret = create_token(
            user, row.client_name, settings.GPULAB_API_TOKEN_DAYS
        )
    except ValidationError as exc:
        row.status = s.DENIED
        row.save(update_fields=["status"])
        return DeviceGrantError("access_denied", " ".join(exc.messages))
    row.status = s.ISSUED
    row.token = token
    row.save(update_fields=["status", "token"])
    return Issued(token, secret)
