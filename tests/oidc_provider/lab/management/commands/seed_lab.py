"""``manage.py seed_lab``: a JSON document on stdin makes (or replaces) the client
and the users, with their lab claims and an ``active`` flag:

    {"client": {"id": ..., "secret": ..., "redirect_uris": [...],
                "post_logout_redirect_uris": [...], "consent": true},
     "users": [{"username": ..., "password": ..., "email": ..., "active": true,
                "claims": {"groups": [...], "uid": 20001, ...}}]}

A user seeded with ``"active": false`` is disabled the way Keycloak disables one:
refused at the login page, and every token the provider gave them revoked (their
refresh tokens answer ``invalid_grant``); ``"revoke": true`` revokes their tokens
only (a sign-out everywhere at the provider).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import transaction
from oidc_provider.models import Client, ResponseType, RSAKey, Token

from tests.oidc_provider.lab.models import Claims


class Command(BaseCommand):
    help = "Seed the test provider from JSON on stdin."

    def handle(self, *args: Any, **options: Any) -> None:
        spec = json.load(sys.stdin)
        with transaction.atomic():
            if not RSAKey.objects.exists():
                call_command("creatersakey")
            if "client" in spec:
                self.client(spec["client"])
            for user in spec.get("users", []):
                self.user(user)
        self.stdout.write("seeded")

    def client(self, spec: dict[str, Any]) -> None:
        code, _ = ResponseType.objects.get_or_create(
            value="code", defaults={"description": "code (Authorization Code Flow)"}
        )
        client, _ = Client.objects.update_or_create(
            client_id=spec["id"],
            defaults={
                "name": "gpulab",
                "client_type": "confidential",
                "client_secret": spec["secret"],
                "jwt_alg": "RS256",
                "require_consent": spec.get("consent", True),
                "reuse_consent": False,
                "_redirect_uris": "\n".join(spec["redirect_uris"]),
                "_post_logout_redirect_uris": "\n".join(
                    spec.get("post_logout_redirect_uris", [])
                ),
                "_scope": "openid email profile lab",
            },
        )
        client.response_types.set([code])

    def user(self, spec: dict[str, Any]) -> None:
        user, _ = User.objects.get_or_create(username=spec["username"])
        user.set_password(spec["password"])
        user.email = spec.get("email", "")
        user.first_name = spec.get("first_name", "")
        user.last_name = spec.get("last_name", "")
        user.is_active = bool(spec.get("active", True))
        user.save()
        if not user.is_active or spec.get("revoke"):
            Token.objects.filter(user=user).delete()
        Claims.objects.update_or_create(
            user=user, defaults={"data": spec.get("claims", {})}
        )
