"""Priority classes, defined in one setting (``GPULAB_PRIORITY_CLASSES``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class PriorityClass:
    name: str
    weight: float
    slowdown_cap: float | None
    default_time_limit: int
    max_time_limit: int
    preemptible: bool
    idle_action: str
    # The class of interactive jobs (JupyterLab, terminals): only they run in it.
    interactive: bool = False
    # Idle detection (portal/idle): None = the GPULAB_IDLE_* default.
    idle_threshold: float | None = None
    idle_window: int | None = None
    idle_grace: int | None = None


def all_classes() -> dict[str, PriorityClass]:
    classes = {}
    for name, spec in settings.GPULAB_PRIORITY_CLASSES.items():
        try:
            classes[name] = PriorityClass(name=name, **spec)
        except TypeError as exc:
            raise ImproperlyConfigured(
                f"GPULAB_PRIORITY_CLASSES[{name!r}] is malformed: {exc}"
            ) from None
    return classes


def get_class(name: str) -> PriorityClass | None:
    return all_classes().get(name)


def class_choices() -> list[tuple[str, str]]:
    """The classes a batch job may ask for: every class but the interactive ones."""
    return [(c.name, c.name) for c in all_classes().values() if not c.interactive]


def interactive_class() -> PriorityClass:
    """The class interactive jobs run in: the first with ``interactive`` set."""
    for c in all_classes().values():
        if c.interactive:
            return c
    raise ImproperlyConfigured(
        "GPULAB_PRIORITY_CLASSES has no class with interactive=True"
        " (interactive jobs need one)."
    )
