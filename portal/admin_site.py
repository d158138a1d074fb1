"""The admin console's site: staff only, and a signed-in user who is not staff
gets 403 Forbidden on every console page, not the admin's login form again
(signing in again would not make them staff); a visitor who is not signed in is sent to
that login form.

``staff_required`` does the same for the console's own pages outside the admin
site's URLs (the overview)."""

from __future__ import annotations

from functools import update_wrapper, wraps
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.urls import reverse

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.http import HttpRequest, HttpResponse, HttpResponseBase

    View = Callable[..., HttpResponse]

_V = TypeVar("_V", bound="Callable[..., HttpResponseBase]")

FORBIDDEN = "Only staff may use the admin console."


class GpulabAdminSite(admin.AdminSite):
    """Django's admin site with a 403 for signed-in users who are not staff."""

    def admin_view(self, view: _V, cacheable: bool = False) -> _V:  # noqa: FBT001, FBT002
        checked = super().admin_view(view, cacheable)

        def inner(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if (
                request.user.is_authenticated
                and not self.has_permission(request)
                and request.path != reverse("admin:logout", current_app=self.name)
            ):
                raise PermissionDenied(FORBIDDEN)
            return checked(request, *args, **kwargs)

        wrapped = update_wrapper(inner, checked)
        wrapped.admin_site = self  # type: ignore[attr-defined]
        return cast("_V", wrapped)


def staff_required(view: View) -> View:
    """A console page outside the admin site's URLs: staff only; 403 for a
    signed-in user who is not staff, the admin login for anyone else."""

    @wraps(view)
    def inner(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = request.user
        if user.is_active and user.is_staff:
            return view(request, *args, **kwargs)
        if user.is_authenticated:
            raise PermissionDenied(FORBIDDEN)
        from django.contrib.auth.views import redirect_to_login

        return redirect_to_login(request.get_full_path(), reverse("admin:login"))

    return inner
