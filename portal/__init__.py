"""The gpulab Django project: settings, ASGI/Celery apps, web UI, accounts."""

from __future__ import annotations

from portal.celery import app as celery_app

__all__ = ["celery_app"]
