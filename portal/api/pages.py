"""The Tokens page: a user's personal API tokens (for ``gpulab login`` and
scripts), created (the secret shown once) and revoked; and the page where a
signed-in user approves or denies a ``gpulab login`` through the browser
(``device_login``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import redis
from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from portal.api import throttling, tokens
from portal.api.models import ApiToken

if TYPE_CHECKING:
    from django.http import HttpResponse

    from portal.http import AuthenticatedHttpRequest

log = logging.getLogger(__name__)


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Where it is used, e.g. laptop.")
    days = forms.IntegerField(
        label="Expires after (days)",
        min_value=0,
        max_value=tokens.MAX_DAYS,
        required=False,
        help_text="0: never.",
    )


@login_required
def token_list(request: AuthenticatedHttpRequest) -> HttpResponse:
    form = TokenForm(
        request.POST or None, initial={"days": settings.GPULAB_API_TOKEN_DAYS}
    )
    secret = None
    status = 200
    if request.method == "POST":
        if form.is_valid():
            days = form.cleaned_data["days"]
            try:
                _token, secret = tokens.create_token(
                    request.user,
                    form.cleaned_data["name"],
                    settings.GPULAB_API_TOKEN_DAYS if days is None else days,
                )
            except ValidationError as exc:
                for field, errs in exc.message_dict.items():
                    for e in errs:
                        form.add_error(field if field in form.fields else None, e)
            else:
                form = TokenForm(initial={"days": settings.GPULAB_API_TOKEN_DAYS})
        if secret is None:
            status = 400
    rows = ApiToken.objects.filter(user=request.user).select_related(
        "device_authorization"
    )
    response = render(
        request,
        "api/tokens.html",
        {"form": form, "tokens": rows, "secret": secret},
        status=status,
    )
    if secret is not None:
        response["Cache-Control"] = "no-store"  # the page holds the secret
    return response


@require_POST
@login_required
def token_revoke(request: AuthenticatedHttpRequest, token_id: int) -> HttpResponse:
    if tokens.revoke_token(request.user, token_id):
        messages.success(request, "Token revoked: it stops working at once.")
    else:
        messages.error(request, "No such active token of yours.")
    return redirect("api-tokens")


def _lookups_left(request: AuthenticatedHttpRequest) -> float:
    """Spend one of the user's code lookups (a brute-force limit); 0 when
    allowed, else the seconds to wait. Redis away: allowed (logged)."""
    try:
        return throttling.hit(
            f"device-verify:{request.user.pk}",
            settings.GPULAB_DEVICE_VERIFY_RATE,
            settings.GPULAB_DEVICE_VERIFY_WINDOW,
        )
    except redis.RedisError as exc:
        log.warning("device code lookups not limited (Redis: %s)", exc)
        return 0.0


@require_http_methods(["GET", "HEAD", "POST"])
@login_required
def device_login(request: AuthenticatedHttpRequest) -> HttpResponse:
    """``gpulab login``'s approval page. GET without a code: a form to type the
    code the CLI shows; GET ``?code=``: the pending sign-in of that code (the
    machine's name and address, the code to compare) with Approve and Deny;
    POST ``code`` and ``decision``: the decision. Every lookup counts against
    ``GPULAB_DEVICE_VERIFY_RATE``."""
    asked = (request.POST if request.method == "POST" else request.GET).get("code")
    if asked is None and request.method != "POST":
        return render(request, "api/device.html", {"code": ""})
    raw = asked or ""
    context: dict[str, object] = {"code": raw, "error": None, "row": None}
    wait = _lookups_left(request)
    if wait > 0:
        context["error"] = f"Too many codes tried; try again in {int(wait) + 1} s."
        return render(request, "api/device.html", context, status=429)
    try:
        code = tokens.normalise_user_code(raw)
        if request.method == "POST":
            decision = request.POST.get("decision")
            if decision not in ("approve", "deny"):
                raise ValidationError({"code": "Choose Approve or Deny."})
            row = tokens.decide_device_login(
                request.user, code, approve=decision == "approve"
            )
            context["done"] = row
            return render(request, "api/device.html", context)
        pending = tokens.pending_device_login(code)
        if pending is None:
            raise ValidationError(
                {
                    "code": "No sign-in waits with this code: it expired, was "
                    "used, or was mistyped. Run gpulab login again for a new one."
                }
            )
    except ValidationError as exc:
        context["error"] = " ".join(exc.messages)
        return render(request, "api/device.html", context, status=400)
    context["row"] = pending
    return render(request, "api/device.html", context)
