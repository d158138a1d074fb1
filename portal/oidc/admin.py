"""The console's view of the users' identities at the OpenID Connect provider: who
is which subject, when they last signed in and were refreshed, and the last
refresh's problem. Written by sign-ins and the refresh only (the refresh token is
never shown); ``manage.py oidc_handover`` unlinks an account."""

from __future__ import annotations

from django.contrib import admin

from portal.admin.common import ReadOnlyAdmin
from portal.oidc.models import OidcIdentity


@admin.register(OidcIdentity)
class OidcIdentityAdmin(ReadOnlyAdmin[OidcIdentity]):
    list_display = (
        "user",
        "sub",
        "issuer",
        "signed_in_at",
        "refreshed_at",
        "refresh_error",
    )
    list_select_related = ("user",)
    search_fields = ("user__username", "sub")
    exclude = ("refresh_token",)
