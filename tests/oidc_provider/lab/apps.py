from __future__ import annotations

from django.apps import AppConfig


class LabConfig(AppConfig):
    name = "tests.oidc_provider.lab"
    label = "oidc_lab"
    default_auto_field = "django.db.models.BigAutoField"
