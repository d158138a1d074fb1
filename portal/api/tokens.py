"""The verbs on personal API tokens (the only writers of ``ApiToken``): create
(the secret returned once, only its hash kept) and revoke."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from portal.api.models import ApiToken

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
