from __future__ import annotations

from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"
    verbose_name = "Scheduler"

    def ready(self) -> None:
        # Registers the scheduler's Celery tasks in every Django process: the
        # services enqueue the pass by its name (scheduler.pass_requests).
        import scheduler.tasks  # noqa: F401
