"""Production settings: `manage.py check --deploy` is clean with the production
environment that .env.example documents, and each of its settings comes from it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What .env.example tells a production deployment behind a TLS proxy to set.
PRODUCTION = {
    "DJANGO_DEBUG": "false",
    "DJANGO_ALLOWED_HOSTS": "gpulab.lab.example",
    "DJANGO_CSRF_TRUSTED_ORIGINS": "https://gpulab.lab.example",
    "DJANGO_SECURE_COOKIES": "true",
    "DJANGO_SSL_REDIRECT": "true",
    "DJANGO_HSTS_SECONDS": "31536000",
    "DJANGO_HSTS_INCLUDE_SUBDOMAINS": "true",
    "DJANGO_HSTS_PRELOAD": "true",
}


def check_deploy(**env: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DJANGO_") or k == "DJANGO_SETTINGS_MODULE"
    }
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={**base, "DJANGO_SECRET_KEY": secrets.token_urlsafe(50), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_check_deploy_is_clean_with_the_documented_production_env() -> None:
    result = check_deploy(**PRODUCTION)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_the_production_variables_are_the_ones_documented() -> None:
    example = (ROOT / ".env.example").read_text()
    for name in PRODUCTION:
        assert f"#{name}=" in example, f"{name} is not documented in .env.example"


def test_each_https_setting_comes_from_its_variable() -> None:
    # Without the HTTPS variables (the plain-HTTP defaults), the check names
    # exactly what is missing: the settings really are read from the env.
    result = check_deploy(
        DJANGO_ALLOWED_HOSTS="gpulab.lab.example", DJANGO_SECURE_COOKIES="false"
    )

    assert result.returncode != 0
    out = result.stdout + result.stderr
    for warning in ("W004", "W008", "W012", "W016"):  # HSTS, redirect, cookies
        assert f"security.{warning}" in out, out
