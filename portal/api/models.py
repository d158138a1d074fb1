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


# RFC 8628 6.1: consonants only (no vowels: no words; no 0/O, 1/I confusion),
# 8 of them: 20^8 (about 2.6e10) codes.
USER_CODE_ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
USER_CODE_LENGTH = 8


class DeviceAuthorization(models.Model):
    """One ``gpulab login`` through the browser (RFC 8628's device authorization
    grant): the CLI holds the device code (only its hash is stored) and polls
    with it; the user types or follows the user code on the approval page,
    signed in, and approves or denies it. An approved authorization is redeemed
    once for an ``ApiToken`` of its own (``status`` issued, ``token`` set)."""

    class Status(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        DENIED = "denied"
        ISSUED = "issued"

    device_code_hash = models.CharField(max_length=64, unique=True, editable=False)
    user_code = models.CharField(max_length=USER_CODE_LENGTH, unique=True)
    client_name = models.CharField(max_length=100)
    client_address = models.GenericIPAddressField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(db_index=True)
    interval = models.PositiveSmallIntegerField()
    last_polled_at = models.DateTimeField(null=True, blank=True)
    status = models.CharField(
        max_length=10, choices=Status.choices, default=Status.PENDING
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="device_authorizations",
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    token = models.OneToOneField(
        ApiToken,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="device_authorization",
    )

    def __str__(self) -> str:
        return f"{self.shown_code} for {self.client_name} ({self.status})"

    @property
    def shown_code(self) -> str:
        """``BCDF-GHJK``: as the CLI prints it and the page shows it."""
        half = USER_CODE_LENGTH // 2
        return f"{self.user_code[:half]}-{self.user_code[half:]}"
