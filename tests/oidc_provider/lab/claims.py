"""The provider's claims: the standard ones from the Django user, and the scope
``lab`` with whatever ``Claims.data`` holds (groups, uid, gid, gids, ...)."""

from __future__ import annotations

from typing import Any

from oidc_provider.lib.claims import ScopeClaims


def userinfo(claims: dict[str, Any], user: Any) -> dict[str, Any]:
    claims["preferred_username"] = user.username
    claims["email"] = user.email
    claims["given_name"] = user.first_name
    claims["family_name"] = user.last_name
    return claims


class LabScopeClaims(ScopeClaims):  # type: ignore[misc]
    info_lab = ("Lab account", "Your lab groups and Unix account.")

    def scope_lab(self) -> dict[str, Any]:
        from tests.oidc_provider.lab.models import Claims

        found = Claims.objects.filter(user=self.user).first()
        return dict(found.data) if found else {}

    def _clean_dic(self, dic: dict[str, Any]) -> dict[str, Any]:
        # The base class drops empty values; a test may send an empty list.
        return {k: v for k, v in dic.items() if v is not None}
