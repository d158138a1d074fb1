"""The priority classes are defined once: the policy's ``DEFAULT_CLASSES``, from
which the default ``GPULAB_PRIORITY_CLASSES`` setting and the simulator's classes
come; their values are pinned here."""

from __future__ import annotations

from django.conf import settings

from scheduler import classes
from scheduler.policy import DEFAULT_CLASSES, ClassSpec
from scheduler.services.snapshot import class_specs
from scheduler.sim import engine, trace


def test_the_default_classes_keep_their_values():
    assert dict(DEFAULT_CLASSES) == {
        "high": ClassSpec("high", 1.0, preemptible=False, slowdown_cap=1.5),
        "normal": ClassSpec("normal", 0.5, preemptible=False, slowdown_cap=1.5),
        "best-effort": ClassSpec(
            "best-effort", 0.0, preemptible=True, slowdown_cap=None
        ),
        "interactive": ClassSpec(
            "interactive", 1.0, preemptible=False, slowdown_cap=1.5, interactive=True
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
            "interactive": False,
            "idle_action": "notify",
        },
        "normal": {
            "weight": 0.5,
            "slowdown_cap": 1.5,
            "default_time_limit": day,
            "max_time_limit": 7 * day,
            "preemptible": False,
            "interactive": False,
            "idle_action": "notify",
        },
        "best-effort": {
            "weight": 0.0,
            "slowdown_cap": None,
            "default_time_limit": day,
            "max_time_limit": 14 * day,
            "preemptible": True,
            "interactive": False,
            "idle_action": "cancel",
        },
        "interactive": {
            "weight": 1.0,
            "slowdown_cap": 1.5,
            "default_time_limit": 2 * 3600,
            "max_time_limit": 12 * 3600,
            "preemptible": False,
            "interactive": True,
            # culled: warned after 25 min of an idle GPU and no use, ended at 30
            "idle_action": "cancel",
            "idle_window": 1500,
            "idle_grace": 300,
        },
    }


def test_the_simulator_replays_with_the_same_classes():
    assert engine.CLASSES is DEFAULT_CLASSES
    assert trace.CLASS_NAMES == ("high", "normal", "best-effort", "interactive")


def test_batch_jobs_may_choose_every_class_but_the_interactive_one():
    assert classes.class_choices() == [
        ("high", "high"),
        ("normal", "normal"),
        ("best-effort", "best-effort"),
    ]
    assert classes.interactive_class().name == "interactive"


def test_the_scheduler_sees_which_class_is_interactive():
    specs = class_specs()
    assert specs["interactive"].interactive
    assert not any(s.interactive for n, s in specs.items() if n != "interactive")
