from __future__ import annotations

from django.apps import AppConfig


class PrometheusConfig(AppConfig):
    """The Prometheus export; its tables keep the GPU-seconds per group that the
    scrape reports (``portal.prometheus.ledger``)."""

    name = "portal.prometheus"
    label = "prometheus"
    verbose_name = "Prometheus export"
    default_auto_field = "django.db.models.BigAutoField"
