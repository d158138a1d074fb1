"""``{% oidc_button %}``: the login page's OpenID Connect button, only when
OpenID Connect is configured (``portal.settings_oidc``)."""

from __future__ import annotations

from typing import Any

from django import template
from django.conf import settings

register = template.Library()


@register.inclusion_tag("registration/oidc_button.html", takes_context=True)
def oidc_button(context: Any) -> dict[str, Any]:
    return {
        "enabled": settings.GPULAB_OIDC_ENABLED,
        "label": settings.GPULAB_OIDC_BUTTON_LABEL,
        "next": context.get("next", ""),
    }
