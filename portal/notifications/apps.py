from __future__ import annotations

from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    name = "portal.notifications"
    label = "notifications"
    verbose_name = "Notifications"

    def ready(self) -> None:
        from portal.notifications.services import Handlers
        from scheduler import hooks

        hooks.register_notifier(Handlers())
