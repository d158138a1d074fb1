"""``manage.py reset_admin_password``: give the demo admin a new password.

``ensure_admin`` creates the admin once and then leaves it alone, so a lost
password cannot be recovered by setting ``DJANGO_SUPERUSER_PASSWORD`` and running
``make up`` again. With the embedded servers (``make up``'s, running or not)::

    .venv/bin/python -m portal.stack.run -- .venv/bin/python manage.py reset_admin_password

The new password is ``DJANGO_SUPERUSER_PASSWORD`` when set (never printed), else a
random one printed once. The user is ``DJANGO_SUPERUSER_USERNAME`` or ``admin``.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = (
        "Set the admin user's password (DJANGO_SUPERUSER_USERNAME, else 'admin') "
        "to DJANGO_SUPERUSER_PASSWORD, else to a random one printed once."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        username = os.environ.get("DJANGO_SUPERUSER_USERNAME") or "admin"
        password = os.environ.get("DJANGO_SUPERUSER_PASSWORD")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(
                f"no user {username!r}: `manage.py ensure_admin` (run by make up)"
                " creates it"
            )
        generated = not password
        password = password or secrets.token_urlsafe(12)
        user.set_password(password)
        user.save(update_fields=["password"])
        if generated:
            self.stdout.write(
                self.style.SUCCESS(
                    f"user {username!r} has the new password {password!r} (shown once)"
                )
            )
        else:
            self.stdout.write(
                f"user {username!r} has the password in DJANGO_SUPERUSER_PASSWORD"
            )
