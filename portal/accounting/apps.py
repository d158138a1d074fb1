from __future__ import annotations

from django.apps import AppConfig


class AccountingConfig(AppConfig):
    name = "portal.accounting"
    label = "accounting"
    verbose_name = "Accounting"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from portal.accounting.live import Provider
        from portal.accounting.services import Handlers
        from scheduler import hooks

        hooks.register_accounting(Handlers())
        hooks.register_usage(Provider())
