from __future__ import annotations

from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal"

    def ready(self) -> None:
        # Binds the tasks declared with @shared_task to our Celery app (its
        # settings, broker and queues) in every Django process.
        import portal.celery  # noqa: F401
