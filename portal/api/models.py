"""Personal API tokens: created and revoked by their owner on the Tokens page,
shown once, stored as a SHA-256 hash (the token is 256 random bits: no slow hash
is needed, as for node tokens), with an optional expiry and the last use."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import ClassVar

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from scheduler.models import hash_token

TOKEN_PREFIX = "gpl_"
# How often ``last_used_at`` is written: not on every request (a write per
# request would double the API's cost), but close enough to tell a stale token.
LAST_USED_EVERY = timedelta(minutes=1)


class ApiTokenQuerySet(models.QuerySet["ApiToken"]):
    def usable(self, now: datetime) -> ApiTokenQuerySet:
        """Not revoked and not expired at ``now``."""
        return self.filter(revoked_at__isnull=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now)
        )


class ApiToken(models.Model):
    """A user's personal token for the API and the ``gpulab`` command line.

    Only ``token_hash`` is stored; ``prefix`` (the first characters) lets a user
    tell their tokens apart. Revoking keeps the row (who had what, when) and
    stops it at once."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ("-created_at", "-id")
        indexes: ClassVar = [models.Index(fields=["user", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…) of {self.user}"

    @staticmethod
    def new_secret() -> str:
        return TOKEN_PREFIX + secrets.token_urlsafe(32)

    def set_secret(self, token: str) -> None:
        self.token_hash = hash_token(token)
        self.prefix = token[: len(TOKEN_PREFIX) + 6]

    def is_usable(self, now: datetime) -> bool:
        return self.revoked_at is None and (
            self.expires_at is None or self.expires_at > now
        )

    @property
    def state(self) -> str:
        """ "active", "expired" or "revoked" (for the Tokens page)."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"
