"""Who a user is at the identity provider: the issuer and subject (``sub``) of the ID
token, which never change for one person (a username claim may be renamed or given
to someone else), and the refresh token the periodic refresh uses, encrypted
(``portal.oidc.secrets``)."""

from __future__ import annotations

from typing import ClassVar

from django.conf import settings
from django.db import models


class OidcIdentity(models.Model):
    """One gpulab user's identity at the OpenID Connect provider.

    A sign-in finds the user by (issuer, sub); the username claim only names a new
    account (``portal.oidc.accounts``). ``refresh_token`` is the provider's latest
    refresh token, encrypted with ``GPULAB_OIDC_TOKEN_KEY`` (empty: none to use, e.g.
    after the provider refused it); ``refresh_error`` the last refresh's problem,
    for the admin console.
    """

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="oidc"
    )
    issuer = models.CharField(max_length=255)
    sub = models.CharField("subject", max_length=255)
    refresh_token = models.TextField(blank=True, default="")
    signed_in_at = models.DateTimeField()
    refreshed_at = models.DateTimeField(null=True, blank=True)
    refresh_error = models.TextField(blank=True, default="")

    class Meta:
        verbose_name = "OpenID Connect identity"
        verbose_name_plural = "OpenID Connect identities"
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["issuer", "sub"], name="oidc_identity_issuer_sub_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.sub} at {self.issuer}"
