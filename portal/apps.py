from __future__ import annotations

from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal"

    def ready(self) -> None:
        # Binds the tasks declared with @shared_task to our Celery app (its
        # settings, broker and queues) in every Django process.
        import portal.celery  # noqa: F401


class GpulabAdminConfig(admin_apps.AdminConfig):
    """``django.contrib.admin`` with ``portal.admin_site.GpulabAdminSite`` as
    ``admin.site``: 403 for signed-in users who are not staff. Named in
    INSTALLED_APPS instead of ``django.contrib.admin``."""

    default = False  # the portal app's own config stays PortalConfig
    default_site = "portal.admin_site.GpulabAdminSite"
