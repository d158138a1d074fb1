"""Django settings for gpulab.

Everything environment-specific comes from environment variables (documented in
``.env.example``); there are no per-environment settings modules. Settings only read
``DATABASE_URL`` and ``REDIS_URL``: the entry points (``make up``, ``make test``,
``python -m portal.stack.run``) start embedded servers when those are unset.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

from agents.protocol import MAX_COMMAND_CHARS
from portal.settings_env import (
    envbool,
    envchoice,
    envfloat,
    envfloat_or_none,
    envint,
    envlist,
    envnetworks,
    envsecret,
    envstr,
    envurl,
)
from portal.stack.urls import celery_broker_url
from scheduler.policy import DEFAULT_CLASSES

# Django generics (ModelAdmin[Job]) become subscriptable at run time.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = envbool("DJANGO_DEBUG", default=False)
SECRET_KEY = envsecret(
    "DJANGO_SECRET_KEY",
    # Only a DEBUG server may run without a secret key of its own.
    "insecure-dev-key-do-not-use-in-production" if DEBUG else None,
)
ALLOWED_HOSTS = envlist("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = envlist("DJANGO_CSRF_TRUSTED_ORIGINS", [])

STATE_DIR = Path(envstr("GPULAB_STATE_DIR", str(BASE_DIR / "var")))

INSTALLED_APPS = [
    "portal.apps.GpulabAdminConfig",  # django.contrib.admin; 403 for non-staff
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "channels",
    "django_htmx",
    "portal",
    "scheduler",
    "portal.quotas",
    "portal.accounting",
    "portal.notifications",
    "portal.idle",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from static
    "portal.api",
    "portal.oidc",
    "portal.prometheus",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "portal.api.middleware.ApiErrorMiddleware",
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"

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
            ],
        },
    },
]

# ------------------------------------------------------------------ PostgreSQL
DATABASE_URL = envurl("DATABASE_URL", ("postgres", "postgresql"))
DATABASES: dict[str, Any] = {
    "default": dj_database_url.parse(
        DATABASE_URL,
        conn_max_age=envint("GPULAB_DB_CONN_MAX_AGE", 60, minimum=0),
        conn_health_checks=True,
    )
}
# The web process (ASGI: portal/asgi.py sets GPULAB_DB_POOL) runs each request's
# sync code on a thread of its own, so a persistent connection per thread would
# stay open after its thread ended: under a burst of API calls one web process
# held 95 idle connections and the server refused everyone else ("too many
# clients"). Django says to disable persistent connections under ASGI and pool
# instead: there, psycopg's pool bounds the process to GPULAB_DB_POOL_MAX
# connections (a request waits up to 10 s for one). Workers and commands keep
# persistent connections.
DB_POOL = envbool("GPULAB_DB_POOL", default=False)
DB_POOL_MAX = envint("GPULAB_DB_POOL_MAX", 10, minimum=1)
if DB_POOL:
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": DB_POOL_MAX,
        "timeout": 10,
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# ------------------------------------------------------------------ Redis
REDIS_URL = envurl("REDIS_URL", ("redis", "rediss", "unix"))
# Prefix of every key, channel group and Celery queue this deployment uses in Redis,
# so two portals (or two test runs) can share one Redis without seeing each other.
REDIS_PREFIX = envstr("GPULAB_REDIS_PREFIX", "gpulab")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [{"address": REDIS_URL}],
            "prefix": f"{REDIS_PREFIX}:asgi",
            "capacity": envint("GPULAB_CHANNEL_CAPACITY", 1000, minimum=10),
            "expiry": 60,
        },
    }
}

# ------------------------------------------------------------------ Celery
# kombu spells a Unix socket redis+socket:// (REDIS_URL may be unix://).
CELERY_BROKER_URL = celery_broker_url(REDIS_URL)
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{REDIS_PREFIX}:celery:"}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = f"{REDIS_PREFIX}.default"
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TRACK_STARTED = True
CELERY_TASK_TIME_LIMIT = envint("GPULAB_CELERY_TASK_TIME_LIMIT", 300, minimum=1)
CELERY_TASK_SOFT_TIME_LIMIT = max(1, CELERY_TASK_TIME_LIMIT - 10)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
GPULAB_SCHEDULE_INTERVAL = envfloat("GPULAB_SCHEDULE_INTERVAL", 5.0, minimum=0.5)
# A pass asked for while one runs follows it at the earliest this many seconds
# after that one started (a burst's passes coalesced; a first pass never waits).
GPULAB_PASS_MIN_SPACING = envfloat(
    "GPULAB_PASS_MIN_SPACING", 1.0, minimum=0.0, maximum=60.0
)
# A pass slower than this (seconds), or one that stopped before the end of the
# queue, is logged at INFO with its statistics; the others at DEBUG. The last
# GPULAB_PASS_LOG_SIZE passes' statistics are kept for the admin overview.
GPULAB_PASS_SLOW_S = envfloat("GPULAB_PASS_SLOW_S", 1.0, minimum=0.0)
GPULAB_PASS_LOG_SIZE = envint("GPULAB_PASS_LOG_SIZE", 100, minimum=1, maximum=10000)
CELERY_BEAT_SCHEDULE = {
    "schedule-pass": {
        "task": "scheduler.tasks.schedule_pass",
        "schedule": GPULAB_SCHEDULE_INTERVAL,
    },
    "maintain-metrics": {
        "task": "scheduler.tasks.maintain_metrics",
        "schedule": 60.0,
    },
    # The GPU hours of the admin overview (portal.accounting.hours).
    "maintain-gpu-hours": {
        "task": "portal.accounting.tasks.maintain_hours",
        "schedule": 60.0,
    },
    "check-nodes": {
        "task": "scheduler.tasks.check_nodes",
        "schedule": envfloat("GPULAB_CHECK_NODES_INTERVAL", 10.0, minimum=0.5),
    },
}
# Notification deliveries (webhooks, e-mail) go to a queue of their own, which the
# `notifier` worker consumes: a slow receiver never holds up a scheduling pass.
CELERY_TASK_ROUTES = ("portal.notifications.tasks.route",)

# ------------------------------------------------------------------ notifications
# E-mail: Django's mail backend. console (prints mail: the default with DEBUG),
# smtp (the default otherwise), file (GPULAB_EMAIL_FILE_PATH), locmem, dummy.
_EMAIL_BACKENDS = {
    "smtp": "django.core.mail.backends.smtp.EmailBackend",
    "console": "django.core.mail.backends.console.EmailBackend",
    "file": "django.core.mail.backends.filebased.EmailBackend",
    "locmem": "django.core.mail.backends.locmem.EmailBackend",
    "dummy": "django.core.mail.backends.dummy.EmailBackend",
}
EMAIL_BACKEND = _EMAIL_BACKENDS[
    envchoice(
        "GPULAB_EMAIL_BACKEND", "console" if DEBUG else "smtp", tuple(_EMAIL_BACKENDS)
    )
]
if _EMAIL_BACKENDS["file"] == EMAIL_BACKEND:
    EMAIL_FILE_PATH = envstr("GPULAB_EMAIL_FILE_PATH", str(STATE_DIR / "mail"))
EMAIL_HOST = envstr("GPULAB_EMAIL_HOST", "localhost")
EMAIL_PORT = envint("GPULAB_EMAIL_PORT", 25, minimum=1, maximum=65535)
EMAIL_HOST_USER = envstr("GPULAB_EMAIL_USER", "")
EMAIL_HOST_PASSWORD = envsecret("GPULAB_EMAIL_PASSWORD", "")
EMAIL_USE_TLS = envbool("GPULAB_EMAIL_TLS", default=False)
EMAIL_TIMEOUT = envint("GPULAB_EMAIL_TIMEOUT", 10, minimum=1)
DEFAULT_FROM_EMAIL = envstr("GPULAB_EMAIL_FROM", "gpulab <gpulab@localhost>")
# The portal's public address, for links in notifications (e.g.
# https://gpulab.lab.example); empty: notifications carry no links.
GPULAB_BASE_URL = envstr("GPULAB_BASE_URL", "").rstrip("/")
if GPULAB_BASE_URL and not GPULAB_BASE_URL.startswith(("http://", "https://")):
    raise ImproperlyConfigured(
        f"GPULAB_BASE_URL={GPULAB_BASE_URL!r} must start with http:// or https://"
    )
# A delivery is tried at most this many times, waiting base * 2^(n-1) seconds
# (capped) after the n-th failure; a webhook gets this many seconds to answer.
GPULAB_NOTIFY_MAX_ATTEMPTS = envint("GPULAB_NOTIFY_MAX_ATTEMPTS", 6, minimum=1)
GPULAB_NOTIFY_BACKOFF = envfloat("GPULAB_NOTIFY_BACKOFF", 30.0, minimum=0.1)
GPULAB_NOTIFY_BACKOFF_CAP = envfloat("GPULAB_NOTIFY_BACKOFF_CAP", 3600.0, minimum=1)
GPULAB_WEBHOOK_TIMEOUT = envfloat("GPULAB_WEBHOOK_TIMEOUT", 10.0, minimum=0.1)
# Webhooks may not reach the portal's own network: a URL whose host resolves to a
# loopback, private, link-local, multicast or reserved address is refused (when
# saved, and again at each send, against the address connected to) unless it is
# in one of these networks (comma-separated CIDRs, e.g. 10.20.0.0/16; default
# none).
GPULAB_WEBHOOK_ALLOWED_NETWORKS = envnetworks("GPULAB_WEBHOOK_ALLOWED_NETWORKS")
# Users' webhook secrets are stored encrypted (Fernet) with a key derived from
# this passphrase (default: from DJANGO_SECRET_KEY). Comma-separated: the first
# encrypts, each one decrypts (to rotate, put the new one first). A secret no key
# can read any more is not sent unsigned: its owner is asked to set it again.
GPULAB_WEBHOOK_SECRET_KEY = [
    key.strip()
    for key in envsecret("GPULAB_WEBHOOK_SECRET_KEY", "").split(",")
    if key.strip()
]
for _key in GPULAB_WEBHOOK_SECRET_KEY:
    if len(_key) < 16:
        raise ImproperlyConfigured(
            "GPULAB_WEBHOOK_SECRET_KEY: each key must be at least 16 characters"
            f" long (one has {len(_key)})"
        )
GPULAB_WEBHOOK_SECRET_KEY = GPULAB_WEBHOOK_SECRET_KEY or [SECRET_KEY]
CELERY_BEAT_SCHEDULE["notifications-sweep"] = {
    "task": "portal.notifications.tasks.sweep",
    "schedule": 30.0,
    # Not piled up while the notifier is down: the next sweep does the same work.
    "options": {"expires": 30.0},
}

# ------------------------------------------------------------------ Auth
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "portal-overview"
LOGOUT_REDIRECT_URL = "login"

SESSION_COOKIE_SECURE = envbool("DJANGO_SECURE_COOKIES", default=not DEBUG)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
# Behind a TLS-terminating proxy, which must set (and strip from clients)
# X-Forwarded-Proto: a request is HTTPS when it says "https".
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# Production over HTTPS (`manage.py check --deploy` is clean with these set; see
# .env.example): redirect plain HTTP to HTTPS, and HSTS. Off by default, because
# `make up`, compose on localhost and the tests serve plain HTTP, and HSTS is
# remembered by browsers for its whole lifetime.
SECURE_SSL_REDIRECT = envbool("DJANGO_SSL_REDIRECT", default=False)
SECURE_HSTS_SECONDS = envint("DJANGO_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool(
    "DJANGO_HSTS_INCLUDE_SUBDOMAINS", default=False
)
SECURE_HSTS_PRELOAD = envbool("DJANGO_HSTS_PRELOAD", default=False)

# ------------------------------------------------------------------ i18n, static
LANGUAGE_CODE = "en-us"
TIME_ZONE = envstr("GPULAB_TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = STATE_DIR / "static"
WHITENOISE_USE_FINDERS = True
# Largest request body (the submit form, the API): generous for commands and envs.
DATA_UPLOAD_MAX_MEMORY_SIZE = 512 * 1024

# ------------------------------------------------------------------ REST API
# /api/v1/ (portal/api): personal tokens (Authorization: Bearer gpl_...) or the
# browser's session (with CSRF); JSON only; errors as {"error", "detail", "fields"}.
REST_FRAMEWORK: dict[str, Any] = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.api.auth.TokenAuthentication",
        "portal.api.auth.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_THROTTLE_CLASSES": ["portal.api.throttling.RedisRateThrottle"],
    "DEFAULT_PARSER_CLASSES": ["portal.api.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "portal.api.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS: dict[str, Any] = {
    "TITLE": "gpulab API",
    "DESCRIPTION": "Jobs, job arrays, nodes and usage of the lab's GPU pool. "
    "Authenticate with a personal token (Tokens page): "
    "`Authorization: Bearer gpl_...`.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "portal.api.schema.query_values_not_empty",
        "portal.api.schema.job_request_kinds",
    ],
    # /api/v1/docs/ loads Swagger UI from this server (drf-spectacular-sidecar):
    # it works offline, and a page carrying the session runs no third-party script.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
}
# Requests per token (or per signed-in user, or per client address before it is
# known who asks) per window, Redis-backed (GCRA: a burst of the whole limit,
# then one request per window/limit); over it: 429 with Retry-After.
GPULAB_API_RATE_LIMIT = envint("GPULAB_API_RATE_LIMIT", 600, minimum=1)
GPULAB_API_RATE_WINDOW = envint("GPULAB_API_RATE_WINDOW", 60, minimum=1)
# Largest API request body, bytes: 413 above it.
GPULAB_API_MAX_BODY_BYTES = envint(
    "GPULAB_API_MAX_BODY_BYTES", 256 * 1024, minimum=1024, maximum=16 * 1024 * 1024
)
# Requests running in Django at once per web process: API calls (/api/) and
# everything else (pages) in separate lanes, pages first (while one runs, other
# clients' light API calls start one at a time); the rest wait in the event loop
# (per client and heavy requests: portal/settings_limits.py), and
# a lane with GPULAB_WEB_QUEUE already waiting answers 503 with Retry-After
# (portal/gate.py). Each running request holds a thread and a database connection.
GPULAB_WEB_API_CONCURRENCY = envint("GPULAB_WEB_API_CONCURRENCY", 4, minimum=1)
GPULAB_WEB_PAGE_CONCURRENCY = envint("GPULAB_WEB_PAGE_CONCURRENCY", 4, minimum=1)
GPULAB_WEB_QUEUE = envint("GPULAB_WEB_QUEUE", 200, minimum=0)
# API calls one client (token, else session, else address) may have in its web
# process at once, running or waiting; the next is answered 429 with Retry-After
# at once (0: no cap). Default: as many as may run at once.
GPULAB_WEB_API_PER_CLIENT = envint(
    "GPULAB_WEB_API_PER_CLIENT", GPULAB_WEB_API_CONCURRENCY, minimum=0
)
# Days a new API token lives unless its owner picks otherwise (0: no expiry).
GPULAB_API_TOKEN_DAYS = envint("GPULAB_API_TOKEN_DAYS", 90, minimum=0)

# ------------------------------------------------------------------ logging

_TASK_LOG_LEVEL = envchoice(
    "GPULAB_TASK_LOG_LEVEL", "WARNING", ("DEBUG", "INFO", "WARNING", "ERROR")
)


def _no_due_task_lines(record: Any) -> bool:
    """celery.beat says "Sending due task" at INFO for every periodic task (a pass
    every few seconds): kept only when GPULAB_TASK_LOG_LEVEL asks for task runs;
    its other lines ("beat: Starting...", failures) stay."""
    return not (
        record.levelno < logging.getLevelName(_TASK_LOG_LEVEL)
        and str(record.msg).startswith("Scheduler: Sending due task")
    )


def _client_errors_in_one_line(record: Any) -> bool:
    """django.request logs a 4xx with the exception that caused it (a 403's
    PermissionDenied): the request was the client's fault, so one line says it;
    a 5xx keeps its traceback."""
    if getattr(record, "status_code", 500) < 500:
        record.exc_info = None
        record.exc_text = None
    return True


LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    # Secrets never reach a log: header values and bearer tokens are blanked.
    "filters": {
        "redact": {"()": "portal.redact.RedactSecrets"},
        "client_errors": {"()": lambda: _client_errors_in_one_line},
        "due_tasks": {"()": lambda: _no_due_task_lines},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["redact"],
        }
    },
    "root": {"handlers": ["console"], "level": envstr("GPULAB_LOG_LEVEL", "INFO")},
    "loggers": {
        # Django's own handlers (a second console copy of each record under
        # DEBUG, mail to ADMINS) are dropped: its records reach the root's once.
        "django": {"level": "INFO"},
        "django.request": {"filters": ["client_errors"]},
        "django.db.backends": {"level": "INFO"},
        "celery": {"level": "INFO"},
        # Each periodic task (the pass every few seconds, node checks) would log
        # "Sending due task", "received" and "succeeded" at INFO: by default only
        # their warnings and failures, the events a person needs
        # (GPULAB_TASK_LOG_LEVEL=INFO shows every task run). Beat's start and
        # its errors stay.
        "celery.beat": {"filters": ["due_tasks"]},
        "celery.worker.strategy": {"level": _TASK_LOG_LEVEL},
        "celery.app.trace": {"level": _TASK_LOG_LEVEL},
        # uvicorn's own handlers are not ours: filter at its logger, where the
        # websockets library logs handshake headers at debug level.
        "uvicorn.error": {"filters": ["redact"]},
    },
}

# ------------------------------------------------------------------ scheduling
# Priority classes (DESIGN.md "Scheduling policy"). Times in seconds; a
# ``slowdown_cap`` of None means unbounded (best-effort shares with anyone who gains).
# The policy's part of each class (weight, slowdown_cap, preemptible) is
# scheduler.policy.DEFAULT_CLASSES; the portal adds its limits and idle action.
# An interactive job whose GPU is idle and that nobody has used through the portal
# (notebook requests, terminal keystrokes: portal/idle/activity.py) for
# GPULAB_INTERACTIVE_IDLE_TIMEOUT seconds is ended; its owner is warned (job page,
# notification) GPULAB_INTERACTIVE_IDLE_WARNING seconds before.
_INTERACTIVE_IDLE_TIMEOUT = envint("GPULAB_INTERACTIVE_IDLE_TIMEOUT", 1800, minimum=60)
_INTERACTIVE_IDLE_WARNING = envint("GPULAB_INTERACTIVE_IDLE_WARNING", 300, minimum=0)
if _INTERACTIVE_IDLE_WARNING >= _INTERACTIVE_IDLE_TIMEOUT:
    raise ImproperlyConfigured(
        f"GPULAB_INTERACTIVE_IDLE_WARNING={_INTERACTIVE_IDLE_WARNING} must be less "
        f"than GPULAB_INTERACTIVE_IDLE_TIMEOUT={_INTERACTIVE_IDLE_TIMEOUT}"
    )
_CLASS_PORTAL_FIELDS: dict[str, dict[str, Any]] = {
    "high": {
        "default_time_limit": 24 * 3600,
        "max_time_limit": 3 * 24 * 3600,
        "idle_action": "notify",
    },
    "normal": {
        "default_time_limit": 24 * 3600,
        "max_time_limit": 7 * 24 * 3600,
        "idle_action": "notify",
    },
    "best-effort": {
        "default_time_limit": 24 * 3600,
        "max_time_limit": 14 * 24 * 3600,
        "idle_action": "cancel",
    },
    # Interactive jobs (docs/interactive.md): short limits, like Slurm's
    # interactive partitions; culled when idle (below).
    "interactive": {
        "default_time_limit": 2 * 3600,
        "max_time_limit": 12 * 3600,
        "idle_action": "cancel",
        "idle_window": _INTERACTIVE_IDLE_TIMEOUT - _INTERACTIVE_IDLE_WARNING,
        "idle_grace": _INTERACTIVE_IDLE_WARNING,
    },
}
GPULAB_PRIORITY_CLASSES: dict[str, dict[str, Any]] = {
    name: {
        "weight": spec.weight,
        "slowdown_cap": spec.slowdown_cap,
        "preemptible": spec.preemptible,
        "interactive": spec.interactive,
        **_CLASS_PORTAL_FIELDS[name],
    }
    for name, spec in DEFAULT_CLASSES.items()
}
GPULAB_DEFAULT_CLASS = "normal"
# Idle GPUs (portal/idle): a running job whose own processes' SM utilisation stays
# below GPULAB_IDLE_THRESHOLD percent on every GPU it holds for GPULAB_IDLE_WINDOW
# seconds is flagged idle and its owner told; when its class's ``idle_action`` is
# "cancel", it is cancelled GPULAB_IDLE_CANCEL_GRACE seconds later if still idle.
# A class may set its own ``idle_threshold`` / ``idle_window`` / ``idle_grace``
# (same units) in GPULAB_PRIORITY_CLASSES. Checked every GPULAB_IDLE_CHECK_INTERVAL s.
GPULAB_IDLE_THRESHOLD = envfloat("GPULAB_IDLE_THRESHOLD", 5.0, minimum=0)
GPULAB_IDLE_WINDOW = envint("GPULAB_IDLE_WINDOW", 1800, minimum=1)
GPULAB_IDLE_CANCEL_GRACE = envint("GPULAB_IDLE_CANCEL_GRACE", 1800, minimum=0)
GPULAB_IDLE_CHECK_INTERVAL = envfloat("GPULAB_IDLE_CHECK_INTERVAL", 60.0, minimum=1)
# Interactive jobs (docs/interactive.md) count a person's use through the portal
# (notebook requests, terminal keystrokes) as activity beside their GPU's; each web
# process records a job's use at most once per this many seconds.
GPULAB_INTERACTIVE_ACTIVITY_RESOLUTION = envfloat(
    "GPULAB_INTERACTIVE_ACTIVITY_RESOLUTION", 30.0, minimum=1
)
CELERY_BEAT_SCHEDULE["idle-check"] = {
    "task": "portal.idle.tasks.check_idle",
    "schedule": GPULAB_IDLE_CHECK_INTERVAL,
    "options": {"expires": GPULAB_IDLE_CHECK_INTERVAL},
}
# The scheduling policy (scheduler.policy.PolicyConfig): name and weights.
GPULAB_POLICY: dict[str, Any] = {
    "name": envchoice(
        "GPULAB_POLICY",
        "gpulab",
        ("fifo", "slurm", "gpulab", "gpulab-exclusive", "pack-by-memory"),
    ),
    "weight_class": envfloat("GPULAB_WEIGHT_CLASS", 1000.0, minimum=0),
    "weight_age": envfloat("GPULAB_WEIGHT_AGE", 500.0, minimum=0),
    "weight_fairshare": envfloat("GPULAB_WEIGHT_FAIRSHARE", 1000.0, minimum=0),
    "fairshare_user": envfloat("GPULAB_FAIRSHARE_USER", 1.0, minimum=0, maximum=1),
    "weight_size": envfloat("GPULAB_WEIGHT_SIZE", 100.0, minimum=0),
    "weight_runtime": envfloat("GPULAB_WEIGHT_RUNTIME", 500.0, minimum=0),
    "runtime_ref_s": envfloat("GPULAB_RUNTIME_REF", 6 * 3600.0, minimum=3600),
    "runtime_age_gpu_s": envfloat("GPULAB_RUNTIME_AGE", 0.0, minimum=0),
    "runtime_age_min_gpus": envint("GPULAB_RUNTIME_AGE_MIN_GPUS", 1, minimum=1),
    "max_age_s": envfloat("GPULAB_MAX_AGE", 7 * 86400.0, minimum=60),
    "backfill": envbool("GPULAB_BACKFILL", default=True),
    # gpulab: plan backfill with time limits (default) or min(limit, prediction)
    "backfill_plan": envchoice(
        "GPULAB_BACKFILL_PLAN", "limit", ("limit", "prediction")
    ),
    # how a waiting job's run time is predicted (scheduler.policy.predict)
    "prediction": envchoice("GPULAB_PREDICTION", "longest", ("longest", "pools")),
    "preempt_max_per_hour": envint("GPULAB_PREEMPT_MAX_PER_HOUR", 2, minimum=0),
    # Co-location (docs/colocation.md): the admission rule's knobs.
    "colocation": envbool("GPULAB_COLOCATION", default=True),
    "colo_headroom_mib": envint("GPULAB_COLO_HEADROOM_MIB", 512, minimum=0),
    "colo_gain_margin": envfloat("GPULAB_COLO_GAIN_MARGIN", 0.05, minimum=0),
    "colo_trial_gain_margin": envfloat(
        "GPULAB_COLO_TRIAL_GAIN_MARGIN", 0.10, minimum=0
    ),
    "colo_min_confidence": envfloat("GPULAB_COLO_MIN_CONFIDENCE", 0.5, minimum=0),
    "colo_trials_per_pair_hour": envint(
        "GPULAB_COLO_TRIALS_PER_PAIR_HOUR", 1, minimum=0
    ),
    "colo_trials_per_hour": envint("GPULAB_COLO_TRIALS_PER_HOUR", 10, minimum=0),
    "colo_trial_min_odds": envfloat(
        "GPULAB_COLO_TRIAL_MIN_ODDS", 0.0, minimum=0, maximum=1
    ),
    "colo_trial_max_failures": envint("GPULAB_COLO_TRIAL_MAX_FAILURES", 0, minimum=0),
    # unset: off (a trial is measured for half the window like any pair)
    "colo_trial_evict_margin": envfloat_or_none(
        "GPULAB_COLO_TRIAL_EVICT_MARGIN", minimum=0
    ),
    "colo_packing": envchoice(
        "GPULAB_COLO_PACKING", "exclusive-first", ("exclusive-first", "pack")
    ),
    "colo_detect_window_s": envfloat("GPULAB_COLO_DETECT_WINDOW", 600.0, minimum=60),
    "colo_cap_margin": envfloat("GPULAB_COLO_CAP_MARGIN", 0.02, minimum=0),
    # "off": a shared job is judged by its current measurement alone
    "colo_evict_z": envfloat_or_none("GPULAB_COLO_EVICT_Z", default=2.0, minimum=0),
    # a pair seen before and refused for protection is tried again while within
    # this many standard errors of its record of the cap ("off": never)
    "colo_retrial_z": envfloat_or_none("GPULAB_COLO_RETRIAL_Z", default=2.0, minimum=0),
    "colo_retrial_episodes": envint("GPULAB_COLO_RETRIAL_EPISODES", 3, minimum=1),
    # Quotas (``policy.quota``): a job over a soft quota has its fair-share factor multiplied
    # by this (0-1); a running job over a hard quota: "finish" or "stop".
    "quota_soft_factor": envfloat(
        "GPULAB_QUOTA_SOFT_FACTOR", 0.5, minimum=0, maximum=1
    ),
    "quota_overrun": envchoice("GPULAB_QUOTA_OVERRUN", "finish", ("finish", "stop")),
}
# Half-life of past usage in fair share, seconds (Slurm's PriorityDecayHalfLife).
GPULAB_FAIRSHARE_HALF_LIFE = envint("GPULAB_FAIRSHARE_HALF_LIFE", 7 * 86400, minimum=60)
# How a GPU shared by several jobs is charged (portal/accounting): "memory", in
# proportion to each job's declared GPU memory (a job without a declaration counts
# as the GPU's whole memory), or "equal", the same part each.
GPULAB_SHARED_CHARGE = envchoice("GPULAB_SHARED_CHARGE", "memory", ("memory", "equal"))
# Jobs that may share one GPU at most (its number of allocation slots).
GPULAB_GPU_JOB_LIMIT = envint("GPULAB_GPU_JOB_LIMIT", 2, minimum=1)
# Group that users without any group are put in when they first submit.
GPULAB_DEFAULT_GROUP = envstr("GPULAB_DEFAULT_GROUP", "lab")
# Seconds without a heartbeat after which a node is LOST and its jobs requeued;
# only time the portal could hear counts (services.presence.hearing_since).
GPULAB_NODE_LOST_AFTER = envint("GPULAB_NODE_LOST_AFTER", 60, minimum=5)
# The reconciler (services.reconcile, beat every GPULAB_RECONCILE_INTERVAL s)
# compares what each agent says it holds (heartbeats, hello) with the database: an
# attempt the agent holds although the portal ended it is killed (stale), and a
# started attempt the agent's reports have lacked for GPULAB_RECONCILE_GRACE s is
# ended as lost (requeued or failed per the job). Keep the grace at several agent
# heartbeats (5 s).
GPULAB_RECONCILE_INTERVAL = envfloat("GPULAB_RECONCILE_INTERVAL", 30.0, minimum=0.5)
GPULAB_RECONCILE_GRACE = envint("GPULAB_RECONCILE_GRACE", 60, minimum=2)
CELERY_BEAT_SCHEDULE["reconcile"] = {
    "task": "scheduler.tasks.reconcile",
    "schedule": GPULAB_RECONCILE_INTERVAL,
    "options": {"expires": GPULAB_RECONCILE_INTERVAL},
}
# What one agent connection may send: frames and bytes per second, with this many
# seconds' worth saved up for bursts (a spool replayed after an outage). A node
# sending faster is throttled: its frames wait, none is dropped.
GPULAB_AGENT_MAX_FRAMES_PER_S = envfloat(
    "GPULAB_AGENT_MAX_FRAMES_PER_S", 200.0, minimum=1
)
GPULAB_AGENT_MAX_BYTES_PER_S = envint(
    "GPULAB_AGENT_MAX_BYTES_PER_S", 8 * 1024 * 1024, minimum=64 * 1024
)
GPULAB_AGENT_BURST_S = envfloat("GPULAB_AGENT_BURST_S", 10.0, minimum=1)
# A launch (one rank's, for a job spanning nodes) with no start reported after this
# many seconds is sent again to its node, if connected; after GPULAB_LAUNCH_RESENDS
# re-sends the attempt is given up. A job whose attempts could not launch (launch
# never arrived, rendezvous port busy) is relaunched at most GPULAB_RELAUNCH_MAX
# times, then fails.
GPULAB_LAUNCH_RESEND_AFTER = envint("GPULAB_LAUNCH_RESEND_AFTER", 30, minimum=5)
GPULAB_LAUNCH_RESENDS = envint("GPULAB_LAUNCH_RESENDS", 3, minimum=0)
GPULAB_RELAUNCH_MAX = envint("GPULAB_RELAUNCH_MAX", 3, minimum=0)
# Default SIGTERM -> SIGKILL grace for a job, seconds.
GPULAB_KILL_GRACE = envint("GPULAB_KILL_GRACE", 30, minimum=0)
# A kill (cancel, requeue, preemption, ...) whose exit has not come back this many
# seconds after the job's kill grace ran out is sent again to its node, if
# connected, until the agent reports the end (services.resend_kills).
GPULAB_KILL_RESEND_AFTER = envint("GPULAB_KILL_RESEND_AFTER", 30, minimum=1)
# Largest command accepted, bytes.
GPULAB_MAX_COMMAND_BYTES = envint(
    "GPULAB_MAX_COMMAND_BYTES", 16 * 1024, minimum=256, maximum=MAX_COMMAND_CHARS
)
# Job arrays: tasks per array at most; jobs one job may wait for
# (dependencies, after an array's expansion into its tasks).
GPULAB_MAX_ARRAY_SIZE = envint(
    "GPULAB_MAX_ARRAY_SIZE", 1000, minimum=1, maximum=100_000
)
GPULAB_MAX_DEPENDENCIES = envint("GPULAB_MAX_DEPENDENCIES", 1000, minimum=1)
# Job log kept by the portal per job, bytes (the agent keeps the whole file).
GPULAB_LOG_MAX_BYTES = envint("GPULAB_LOG_MAX_BYTES", 4 * 1024 * 1024, minimum=4096)
# Metric history: one sample per GPU persisted every N seconds (the 1 Hz stream stays
# live-only), raw samples kept N days (then their day partitions are dropped),
# minute and hour rollups kept longer.
GPULAB_METRICS_PERSIST_INTERVAL = envint(
    "GPULAB_METRICS_PERSIST_INTERVAL", 10, minimum=1
)
GPULAB_METRICS_RETENTION_DAYS = envint("GPULAB_METRICS_RETENTION_DAYS", 7, minimum=1)
GPULAB_ROLLUP_1M_DAYS = envint("GPULAB_ROLLUP_1M_DAYS", 30, minimum=1)
GPULAB_ROLLUP_1H_DAYS = envint("GPULAB_ROLLUP_1H_DAYS", 400, minimum=1)
# Live dashboards (scheduler.live): at most one update per node, and one aggregated
# cluster update, every GPULAB_LIVE_INTERVAL seconds (at least 1: a bigger cluster
# may want fewer).
GPULAB_LIVE_INTERVAL = envfloat("GPULAB_LIVE_INTERVAL", 1.0, minimum=1.0, maximum=60.0)
# Default working directory of a job when none is given ({user} is the username).
GPULAB_DEFAULT_WORKDIR = envstr("GPULAB_DEFAULT_WORKDIR", "/tmp")
# Each feature's settings live in a module of their own (read from the environment
# the same way): the lab's directory (LDAP and the group mapping), what a job
# request may ask for, interactive jobs, the limits on what one request may cost,
# /metrics, the CLI's sign-in through the browser, OpenID Connect sign-in (after
# the directory's: it adds to its AUTHENTICATION_BACKENDS), when checkpointable
# jobs are preempted.
from portal.settings_device import *  # noqa: E402,F403
from portal.settings_directory import *  # noqa: E402,F403
from portal.settings_input import *  # noqa: E402,F403
from portal.settings_interactive import *  # noqa: E402,F403
from portal.settings_limits import *  # noqa: E402,F403
from portal.settings_metrics import *  # noqa: E402,F403
from portal.settings_oidc import *  # noqa: E402,F403
from portal.settings_preemption import *  # noqa: E402,F403

CELERY_BEAT_SCHEDULE.update(DIRECTORY_BEAT_SCHEDULE)  # noqa: F405
CELERY_BEAT_SCHEDULE.update(METRICS_BEAT_SCHEDULE)  # noqa: F405
CELERY_BEAT_SCHEDULE.update(OIDC_BEAT_SCHEDULE)  # noqa: F405
