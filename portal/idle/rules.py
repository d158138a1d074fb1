"""The idle rule of each priority class, from the settings, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

ACTIONS = ("notify", "cancel")


@dataclass(frozen=True)
class IdleRule:
    """A job is idle when its own processes' SM utilisation stays below
    ``threshold`` percent on every GPU it holds for ``window_s`` seconds; with
    ``action`` "cancel" it is cancelled ``grace_s`` seconds after being flagged if
    it is still idle then."""

    threshold: float
    window_s: int
    grace_s: int
    action: str


def _number(where: str, value: Any, *, low: float, high: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ImproperlyConfigured(f"{where}={value!r} is not a number")
    if value != value or value < low or (high is not None and value > high):
        bound = f"from {low:g} to {high:g}" if high is not None else f"at least {low:g}"
        raise ImproperlyConfigured(f"{where}={value!r} must be {bound}")
    return float(value)


def default_rule(action: str = "notify") -> IdleRule:
    threshold = _number(
        "GPULAB_IDLE_THRESHOLD", settings.GPULAB_IDLE_THRESHOLD, low=0, high=100
    )
    window = settings.GPULAB_IDLE_WINDOW
    _check_window("GPULAB_IDLE_WINDOW", window)
    return IdleRule(threshold, window, settings.GPULAB_IDLE_CANCEL_GRACE, action)


def _check_window(where: str, window: float) -> None:
    # Fewer than two persisted samples in a window is no evidence of anything.
    least = 2 * settings.GPULAB_METRICS_PERSIST_INTERVAL
    if window < least:
        raise ImproperlyConfigured(
            f"{where}={window:g} must be at least twice "
            f"GPULAB_METRICS_PERSIST_INTERVAL ({least} s): a window needs samples"
        )


def all_rules() -> dict[str, IdleRule]:
    """Each class's rule; raises ImproperlyConfigured naming a bad value."""
    base = default_rule()
    rules = {}
    for name, spec in settings.GPULAB_PRIORITY_CLASSES.items():
        where = f"GPULAB_PRIORITY_CLASSES[{name!r}]"
        action = spec.get("idle_action", "notify")
        if action not in ACTIONS:
            raise ImproperlyConfigured(
                f"{where}['idle_action']={action!r} is not one of: {', '.join(ACTIONS)}"
            )
        threshold = base.threshold
        if spec.get("idle_threshold") is not None:
            threshold = _number(
                f"{where}['idle_threshold']", spec["idle_threshold"], low=0, high=100
            )
        window = base.window_s
        if spec.get("idle_window") is not None:
            window = int(
                _number(
                    f"{where}['idle_window']", spec["idle_window"], low=1, high=None
                )
            )
            _check_window(f"{where}['idle_window']", window)
        grace = base.grace_s
        if spec.get("idle_grace") is not None:
            grace = int(
                _number(f"{where}['idle_grace']", spec["idle_grace"], low=0, high=None)
            )
        rules[name] = IdleRule(threshold, window, grace, action)
    return rules


def rule_for(rules: dict[str, IdleRule], priority_class: str) -> IdleRule:
    return rules.get(priority_class) or default_rule()
