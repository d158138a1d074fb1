"""The user's notification page: preferences, a test, and recent deliveries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db import transaction
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.notifications import services
from portal.notifications.forms import PreferenceForm
from portal.notifications.models import Delivery, Kind

if TYPE_CHECKING:
    from django.http import HttpResponse

    from portal.http import AuthenticatedHttpRequest

RECENT = 20


@login_required
def preferences(request: AuthenticatedHttpRequest) -> HttpResponse:
    pref = services.preference_of(request.user)
    form = PreferenceForm(request.POST or None, instance=pref)
    if request.method == "POST" and form.is_valid():
        saved = form.save(commit=False)
        saved.user = request.user
        saved.updated_at = timezone.now()
        saved.save()
        messages.success(request, "Notification preferences saved.")
        return redirect("notifications")
    deliveries = Delivery.objects.filter(user=request.user)[:RECENT]
    return render(
        request,
        "notifications/preferences.html",
        {
            "form": form,
            "has_secret": form.secret_state == "set",
            "secret_unreadable": form.secret_state == "unreadable",
            "deliveries": deliveries,
            "email": request.user.email,
        },
        status=400 if request.method == "POST" else 200,
    )


@require_POST
@login_required
def send_test(request: AuthenticatedHttpRequest) -> HttpResponse:
    """Send a test notification by every channel the saved preferences name."""
    with transaction.atomic():
        made = services.notify(
            request.user,
            Kind.TEST,
            "Test notification",
            "This is a test notification from gpulab: your settings work.",
            {"test": True},
        )
    if made:
        channels = ", ".join(sorted({d.get_channel_display() for d in made}))
        messages.success(
            request, f"Test sent by {channels}; its outcome is listed below."
        )
    else:
        messages.error(
            request,
            "Nothing to send: turn e-mail on (with an address on your account) or "
            "save a webhook first.",
        )
    return redirect("notifications")
