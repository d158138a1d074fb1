from __future__ import annotations

from typing import ClassVar

from django.contrib import admin
from django.db import models

from portal.notifications.models import Delivery, Preference


@admin.register(Preference)
class PreferenceAdmin(admin.ModelAdmin[Preference]):
    list_display = ("user", "email_enabled", "webhook_url", "updated_at")
    search_fields = ("user__username", "webhook_url")
    # The secret is the user's to set (their notifications page), never shown.
    exclude = ("webhook_secret",)
    # As on the user's form: a URL typed without a scheme is https.
    formfield_overrides: ClassVar = {models.URLField: {"assume_scheme": "https"}}


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin[Delivery]):
    list_display = ("created_at", "user", "kind", "channel", "status", "attempts")
    list_filter = ("status", "channel", "kind")
    search_fields = ("user__username", "subject", "target")
    readonly_fields = tuple(f.name for f in Delivery._meta.fields)
