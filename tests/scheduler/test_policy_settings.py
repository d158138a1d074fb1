"""Policy settings from the environment: each reaches ``policy_config`` (what the
pass decides with), and a bad value stops the start naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scheduler.services.snapshot import policy_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_users_part_of_fair_share_reaches_the_policy(settings: Any) -> None:
    assert policy_config().fairshare_user == 1.0
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "fairshare_user": 0.0}
    assert policy_config().fairshare_user == 0.0


def test_only_wide_jobs_earn_the_head_start_when_the_settings_say(
    settings: Any,
) -> None:
    assert policy_config().runtime_age_min_gpus == 1
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "runtime_age_min_gpus": 5}
    assert policy_config().runtime_age_min_gpus == 5


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("GPULAB_FAIRSHARE_USER", "1.5", "GPULAB_FAIRSHARE_USER=1.5 must be at most 1"),
        ("GPULAB_FAIRSHARE_USER", "-0.1", "=-0.1 must be at least 0"),
        (
            "GPULAB_FAIRSHARE_USER",
            "half",
            "GPULAB_FAIRSHARE_USER='half' is not a number",
        ),
        (
            "GPULAB_RUNTIME_AGE_MIN_GPUS",
            "0",
            "GPULAB_RUNTIME_AGE_MIN_GPUS=0 must be at least 1",
        ),
        (
            "GPULAB_RUNTIME_AGE_MIN_GPUS",
            "4.5",
            "GPULAB_RUNTIME_AGE_MIN_GPUS='4.5' is not an integer",
        ),
    ],
)
def test_a_bad_policy_setting_stops_the_start_naming_it(
    name: str, value: str, message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            name: value,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr
    assert message in proc.stderr
