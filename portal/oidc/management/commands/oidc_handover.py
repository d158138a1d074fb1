"""``manage.py oidc_handover USERNAME``: let the identity provider's user of that
name take the account at their next sign-in (``portal.oidc.accounts.hand_over``):
its password is removed and any provider identity linked to it forgotten."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.oidc.accounts import hand_over


class Command(BaseCommand):
    help = "Hand a gpulab account to the OpenID Connect provider's user of its name."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["username"]
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no gpulab account is named {username!r}")
        hand_over(user)
        self.stdout.write(
            f"{username}: no password; the identity provider's user {username!r}"
            " takes the account at their next sign-in"
        )
