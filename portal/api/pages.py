"""The Tokens page: a user's personal API tokens (for ``gpulab login`` and
scripts), created (the secret shown once) and revoked."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from portal.api import tokens
from portal.api.models import ApiToken

if TYPE_CHECKING:
    from django.http import HttpResponse

    from portal.http import AuthenticatedHttpRequest


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
    rows = ApiToken.objects.filter(user=request.user)
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
