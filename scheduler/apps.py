from __future__ import annotations

from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"
    verbose_name = "Scheduler"
