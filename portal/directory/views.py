"""The login page: the user-name/password form when a password can be checked
(locally or by the directory), and a directory outage named on it."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import ValidationError


def password_login_offered() -> bool:
    return bool(settings.GPULAB_LDAP_URI) or settings.GPULAB_LOCAL_LOGIN != "off"


class DirectoryAuthenticationForm(AuthenticationForm):
    """Django's form; a failed sign-in during a directory outage says so (the
    directory backend notes it on the request) instead of "wrong password"."""

    def get_invalid_login_error(self) -> ValidationError:
        problem = getattr(self.request, "directory_error", None)
        if problem:
            return ValidationError(
                f"Could not sign in: {problem}. Try again later, or ask the lab's"
                " admin.",
                code="directory_unavailable",
            )
        return super().get_invalid_login_error()


class DirectoryLoginView(LoginView):
    authentication_form = DirectoryAuthenticationForm

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["password_login"] = password_login_offered()
        context["directory_login"] = bool(settings.GPULAB_LDAP_URI)
        return context
