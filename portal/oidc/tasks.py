"""Celery beat's entry for the OpenID Connect refresh (``portal.oidc.refresh``)."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.conf import settings


@shared_task(ignore_result=True)
def refresh(**kwargs: Any) -> dict[str, int]:
    """Every ``GPULAB_OIDC_REFRESH_INTERVAL`` seconds, when OIDC is on."""
    if not settings.GPULAB_OIDC_ENABLED:
        return {}
    from portal.oidc.refresh import refresh_oidc_users

    return refresh_oidc_users()
