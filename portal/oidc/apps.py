from __future__ import annotations

from django.apps import AppConfig


class OidcConfig(AppConfig):
    """OpenID Connect sign-in: the users' identities at the provider (issuer and
    ``sub``) and their refresh tokens, kept for the periodic refresh."""

    name = "portal.oidc"
    label = "oidc"
    verbose_name = "OpenID Connect"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from portal.oidc import checks  # noqa: F401  (registers the check)
