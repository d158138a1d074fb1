from __future__ import annotations

from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "portal.quotas"
    label = "quotas"
    verbose_name = "Quotas and audit log"

    def ready(self) -> None:
        from portal.quotas.usage import Provider
        from scheduler import hooks

        hooks.register_quotas(Provider())
