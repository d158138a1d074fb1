from __future__ import annotations

from django.conf import settings
from django.db import models


class Claims(models.Model):
    """A user's lab claims, sent as they are stored (any JSON type)."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    data = models.JSONField(default=dict)

    def __str__(self) -> str:
        return f"lab claims of {self.user}"
