"""``manage.py oidc_refresh``: run the OpenID Connect refresh now (what the beat
task does every ``GPULAB_OIDC_REFRESH_INTERVAL``) and print its counts."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Refresh every OpenID Connect user at the provider now."

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.GPULAB_OIDC_ENABLED:
            raise CommandError(
                "OpenID Connect is off (GPULAB_OIDC_DISCOVERY_URL is not set)"
            )
        from portal.oidc.refresh import refresh_oidc_users

        self.stdout.write(json.dumps(refresh_oidc_users(), sort_keys=True))
