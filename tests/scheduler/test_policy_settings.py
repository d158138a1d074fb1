"""Policy settings from the environment: each reaches ``policy_config`` (what the
pass decides with), and a bad value stops the start naming the variable."""

from __future__ import annotations

import pytest

from tests.startup import django_setup


@pytest.mark.parametrize(
    ("name", "value", "field", "expected"),
    [
        ("GPULAB_FAIRSHARE_USER", "0.25", "fairshare_user", 0.25),
        ("GPULAB_FAIRSHARE_USER", "", "fairshare_user", 1.0),
        ("GPULAB_RUNTIME_AGE_MIN_GPUS", "5", "runtime_age_min_gpus", 5),
        ("GPULAB_RUNTIME_AGE_MIN_GPUS", "", "runtime_age_min_gpus", 1),
    ],
)
def test_a_policy_setting_reaches_the_policy(
    name: str, value: str, field: str, expected: float
) -> None:
    """From the environment of a fresh start to what the pass decides with;
    unset (empty), the default."""
    show = (
        "from scheduler.services.snapshot import policy_config\n"
        f"print(repr(policy_config().{field}))"
    )
    proc = django_setup({name: value}, show)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(expected)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("GPULAB_MAX_WAIT", "600", "=600.0 must be 0 (no bound) or at least 3600"),
        ("GPULAB_MAX_WAIT", "two days", "='two days' is not a number"),
        ("GPULAB_MAX_WAIT", "-1", "=-1.0 must be at least 0"),
        (
            "GPULAB_PREEMPTED_MAX_WAIT",
            "60",
            "=60.0 must be 0 (no bound) or at least 600",
        ),
        ("GPULAB_PREEMPTED_MAX_WAIT", "a day", "='a day' is not a number"),
        ("GPULAB_FAIRSHARE_USER", "1.5", "=1.5 must be at most 1"),
        ("GPULAB_FAIRSHARE_USER", "-0.1", "=-0.1 must be at least 0"),
        ("GPULAB_FAIRSHARE_USER", "half", "='half' is not a number"),
        ("GPULAB_RUNTIME_AGE_MIN_GPUS", "0", "=0 must be at least 1"),
        ("GPULAB_RUNTIME_AGE_MIN_GPUS", "4.5", "='4.5' is not an integer"),
    ],
)
def test_a_bad_policy_setting_stops_the_start_naming_it(
    name: str, value: str, message: str
) -> None:
    proc = django_setup({name: value})
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr
    assert name + message in proc.stderr
