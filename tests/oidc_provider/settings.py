"""Settings of the test identity provider (not gpulab's): its database comes from
``OIDC_PROVIDER_DATABASE_URL`` (PostgreSQL)."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = os.environ.get("OIDC_PROVIDER_SECRET_KEY", "test-provider-only-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "oidc_provider",
    "tests.oidc_provider.lab",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.oidc_provider.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {"default": dj_database_url.parse(os.environ["OIDC_PROVIDER_DATABASE_URL"])}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
LOGIN_URL = "/accounts/login/"
# The provider and the portal both run on 127.0.0.1: distinct cookie names, or
# each would overwrite the other's session (cookies ignore the port).
SESSION_COOKIE_NAME = "provider_sessionid"
CSRF_COOKIE_NAME = "provider_csrftoken"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
OIDC_USERINFO = "tests.oidc_provider.lab.claims.userinfo"
OIDC_EXTRA_SCOPE_CLAIMS = "tests.oidc_provider.lab.claims.LabScopeClaims"
OIDC_IDTOKEN_INCLUDE_CLAIMS = False
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "INFO"},
}
