"""The sign-in button's target, the provider's callback and the page after signing
out. Every failure (provider unreachable, an error answer, a refused claim) ends on
the login page with a message naming the server or the claim, and in the log; never
a 500, and local sign-in is untouched.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlencode

import requests
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect
from django.urls import reverse
from mozilla_django_oidc.views import (  # type: ignore[import-untyped]
    OIDCAuthenticationCallbackView,
    OIDCAuthenticationRequestView,
)

from portal.oidc.backend import SignInRefused
from portal.oidc.claims import ClaimError
from portal.oidc.discovery import ProviderUnavailable, describe, provider

log = logging.getLogger(__name__)

# Holds the ID token from sign-in to sign-out (signed, HttpOnly), so the provider's
# end_session_endpoint gets its id_token_hint after the portal session is gone.
ID_TOKEN_COOKIE = "gpulab_oidc"
_SALT = "portal.oidc.id_token"


def _enabled() -> None:
    if not settings.GPULAB_OIDC_ENABLED:
        raise Http404("OpenID Connect sign-in is not configured")


def _refuse(request: HttpRequest, message: str) -> HttpResponse:
    messages.error(request, message)
    return redirect("login")


class Authenticate(OIDCAuthenticationRequestView):  # type: ignore[misc]
    """The login button: to the provider's authorization endpoint (with state,
    nonce and PKCE), once its discovery document has been read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(OIDCAuthenticationRequestView, self).__init__(*args, **kwargs)

    def get(self, request: HttpRequest) -> HttpResponse:
        _enabled()
        try:
            self.OIDC_OP_AUTH_ENDPOINT = provider().authorization_endpoint
        except ProviderUnavailable as exc:
            log.error("oidc sign-in: %s", exc)
            return _refuse(
                request,
                f"{exc}. Try again later, or sign in with a local account.",
            )
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        response: HttpResponse = super().get(request)
        return response


class Callback(OIDCAuthenticationCallbackView):  # type: ignore[misc]
    """The provider's answer: the backend checks the tokens and applies the claims."""

    def get(self, request: HttpRequest) -> HttpResponse:
        _enabled()
        try:
            response: HttpResponse = super().get(request)
        except ProviderUnavailable as exc:
            log.error("oidc callback: %s", exc)
            return _refuse(request, f"{exc}. Try again later.")
        except requests.RequestException as exc:
            server = getattr(exc.request, "url", None) or "the identity provider"
            log.error("oidc callback: %s failed: %s", server, exc)
            return _refuse(
                request,
                f"The identity provider at {server} did not answer the sign-in:"
                f" {_short(exc)}",
            )
        except (ClaimError, SignInRefused) as exc:
            log.warning("oidc sign-in refused: %s", exc)
            return _refuse(request, str(exc))
        except SuspiciousOperation as exc:
            # A replayed or forged callback, a bad signature or nonce.
            log.warning("oidc callback refused: %s", exc)
            return _refuse(request, "The sign-in could not be verified; try again.")
        return response

    def login_failure(self) -> HttpResponse:
        error = self.request.GET.get("error")
        if error:
            detail = self.request.GET.get("error_description") or error
            log.warning("oidc sign-in: the provider answered %s", detail[:200])
            messages.error(
                self.request, f"The identity provider refused the sign-in: {detail}"
            )
        else:
            messages.error(self.request, "The sign-in did not complete; try again.")
        return HttpResponseRedirect(reverse("login"))

    def login_success(self) -> HttpResponse:
        response: HttpResponse = super().login_success()
        id_token = self.request.session.get("oidc_id_token")
        if id_token:
            response.set_signed_cookie(
                ID_TOKEN_COOKIE,
                id_token,
                salt=_SALT,
                max_age=settings.SESSION_COOKIE_AGE,
                secure=settings.SESSION_COOKIE_SECURE,
                httponly=True,
                samesite="Lax",
            )
        return response


def signed_out(request: HttpRequest) -> HttpResponse:
    """Where Django's logout lands (``LOGOUT_REDIRECT_URL``): the portal session is
    already gone; a user who signed in through the provider is sent to its
    end_session_endpoint (when it has one) to end that session too, then back to
    the login page."""
    login_url = reverse("login")
    if request.user.is_authenticated:
        # Not after a sign-out (a link followed while signed in): the provider's
        # session is not ended behind the portal's back.
        return redirect("portal-overview")
    id_token = request.get_signed_cookie(ID_TOKEN_COOKIE, default=None, salt=_SALT)
    target = login_url
    if id_token and settings.GPULAB_OIDC_ENABLED:
        try:
            end_session = provider().end_session_endpoint
        except ProviderUnavailable as exc:
            log.warning("oidc sign-out: %s", exc)
            messages.warning(
                request,
                "Signed out of gpulab; the identity provider could not be reached"
                " to end its own session.",
            )
            end_session = ""
        if end_session:
            query = urlencode(
                {
                    "id_token_hint": id_token,
                    "post_logout_redirect_uri": request.build_absolute_uri(login_url),
                }
            )
            target = f"{end_session}{'&' if '?' in end_session else '?'}{query}"
    response = HttpResponseRedirect(target)
    response.delete_cookie(ID_TOKEN_COOKIE, samesite="Lax")
    return response


def _short(exc: requests.RequestException) -> str:
    response = exc.response
    if response is not None:
        return f"HTTP {response.status_code}"
    return describe(exc).split(":")[0][:120]
