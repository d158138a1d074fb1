"""The priority classes are defined once: the policy's ``DEFAULT_CLASSES``, from
which the default ``GPULAB_PRIORITY_CLASSES`` setting and the simulator's classes
come; their values are pinned here."""

from __future__ import annotations

from django.conf import settings

from scheduler.policy import DEFAULT_CLASSES, ClassSpec
from scheduler.sim import engine, trace


def test_the_default_classes_keep_their_values():
    assert dict(DEFAULT_CLASSES) == {
        "high": ClassSpec("high", 1.0, preemptible=False, slowdown_cap=1.5),
        "normal": ClassSpec("normal", 0.5, preemptible=False, slowdown_cap=1.5),
        "best-effort": ClassSpec(
            "best-effort", 0.0, preemptible=True, slowdown_cap=None
        ),
    }


def test_the_setting_is_derived_from_them_with_the_portal_fields():
    day = 24 * 3600
    got = settings.GPULAB_PRIORITY_CLASSES
    assert got == {
        "high": {
            "weight": 1.0,
            "slowdown_cap": 1.5,
            "default_time_limit": day,
            "max_time_limit": 3 * day,
            "preemptible": False,
            "idle_action": "notify",
        },
        "normal": {
            "weight": 0.5,
            "slowdown_cap": 1.5,
            "default_time_limit": day,
            "max_time_limit": 7 * day,
            "preemptible": False,
            "idle_action": "notify",
        },
        "best-effort": {
            "weight": 0.0,
            "slowdown_cap": None,
            "default_time_limit": day,
            "max_time_limit": 14 * day,
            "preemptible": True,
            "idle_action": "cancel",
        },
    }


def test_the_simulator_replays_with_the_same_classes():
    assert engine.CLASSES is DEFAULT_CLASSES
    assert trace.CLASS_NAMES == ("high", "normal", "best-effort")
