from __future__ import annotations

from django.apps import AppConfig


class IdleConfig(AppConfig):
    name = "portal.idle"
    label = "idle"
    verbose_name = "Idle GPUs"

    def ready(self) -> None:
        # A bad per-class idle setting stops the process at start, naming it.
        from portal.idle.rules import all_rules

        all_rules()
