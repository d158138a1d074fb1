"""Bad idle and notification settings stop the process at start, naming the
variable (a real Django start in a subprocess)."""

from __future__ import annotations

import pytest

from tests.startup import django_setup


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"GPULAB_EMAIL_BACKEND": "pigeon"},
            "GPULAB_EMAIL_BACKEND='pigeon' is not one of: smtp, console",
        ),
        (
            {"GPULAB_BASE_URL": "gpulab.lab.example"},
            "GPULAB_BASE_URL='gpulab.lab.example' must start with http:// or https://",
        ),
        (
            {"GPULAB_IDLE_THRESHOLD": "lots"},
            "GPULAB_IDLE_THRESHOLD='lots' is not a number",
        ),
        (
            {"GPULAB_IDLE_THRESHOLD": "120"},
            "GPULAB_IDLE_THRESHOLD=120.0 must be from 0 to 100",
        ),
        (
            {"GPULAB_IDLE_WINDOW": "15"},
            "GPULAB_IDLE_WINDOW=15 must be at least twice GPULAB_METRICS_PERSIST_INTERVAL",
        ),
        (
            {"GPULAB_INTERACTIVE_IDLE_WARNING": "1800"},
            "GPULAB_INTERACTIVE_IDLE_WARNING=1800 must be less than "
            "GPULAB_INTERACTIVE_IDLE_TIMEOUT=1800",
        ),
        (
            # The warning leaves a window too short to hold two samples.
            {
                "GPULAB_INTERACTIVE_IDLE_TIMEOUT": "60",
                "GPULAB_INTERACTIVE_IDLE_WARNING": "50",
            },
            "GPULAB_PRIORITY_CLASSES['interactive']['idle_window']=10 must be at least twice",
        ),
        (
            {"GPULAB_WEBHOOK_TIMEOUT": "0"},
            "GPULAB_WEBHOOK_TIMEOUT=0.0 must be at least",
        ),
        (
            {"GPULAB_WEBHOOK_ALLOWED_NETWORKS": "10.0.0.0/8, the-lab"},
            "GPULAB_WEBHOOK_ALLOWED_NETWORKS: 'the-lab' is not an IP network",
        ),
        (
            {"GPULAB_WEBHOOK_SECRET_KEY": "short"},
            "GPULAB_WEBHOOK_SECRET_KEY: each key must be at least 16 characters",
        ),
    ],
)
def test_a_bad_setting_stops_the_start_naming_it(
    env: dict[str, str], message: str
) -> None:
    proc = django_setup(env)
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr
    assert message in proc.stderr


def test_interactive_jobs_are_culled_after_the_timeout_with_a_warning_before() -> None:
    """The interactive class's idle rule: flagged (the warning) after the timeout
    less the warning, cancelled the warning later."""
    from portal.idle.rules import all_rules

    rule = all_rules()["interactive"]
    assert (rule.action, rule.window_s, rule.grace_s) == ("cancel", 1500, 300)
