"""``manage.py ensure_admin``: create the demo superuser once."""

from __future__ import annotations

import os
import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from scheduler import services


class Command(BaseCommand):
    help = (
        "Create the admin user from DJANGO_SUPERUSER_USERNAME / "
        "DJANGO_SUPERUSER_PASSWORD, else 'admin' with a random password printed "
        "once. Does nothing if the user exists."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        username = os.environ.get("DJANGO_SUPERUSER_USERNAME") or "admin"
        password = os.environ.get("DJANGO_SUPERUSER_PASSWORD")
        if user_model.objects.filter(username=username).exists():
            self.stdout.write(f"admin user {username!r} exists")
            return
        generated = password is None
        password = password or secrets.token_urlsafe(12)
        user = user_model.objects.create_superuser(
            username=username,
            email=os.environ.get("DJANGO_SUPERUSER_EMAIL", ""),
            password=password,
        )
        services._charge_group(user, "")  # the admin joins the default group
        if generated:
            self.stdout.write(
                self.style.SUCCESS(
                    f"created admin user {username!r} with password {password!r} "
                    "(shown once; change it in the admin console)"
                )
            )
        else:
            self.stdout.write(f"created admin user {username!r}")
