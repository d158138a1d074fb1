"""Settings of the Prometheus export (``/metrics``, ``portal/prometheus/``).

The export is off unless one of the two is set, so a fresh install never shows
its queue, users and job ids to anyone who can reach the port:

- ``GPULAB_METRICS_TOKEN`` (or ``GPULAB_METRICS_TOKEN_FILE``): a scraper must send
  ``Authorization: Bearer <token>`` (Prometheus' ``authorization`` /
  ``bearer_token_file``); at least 16 characters.
- ``GPULAB_METRICS_ALLOWED_NETWORKS``: comma-separated CIDRs; only clients whose
  address is inside one may scrape.

Both set: a scrape needs both. The address is the connection's (``REMOTE_ADDR``),
not a forwarded header a client could write itself.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from portal.settings_env import envfloat, envnetworks, envsecret

GPULAB_METRICS_TOKEN = envsecret("GPULAB_METRICS_TOKEN", "")
if GPULAB_METRICS_TOKEN and len(GPULAB_METRICS_TOKEN) < 16:
    raise ImproperlyConfigured(
        "GPULAB_METRICS_TOKEN must be at least 16 characters (it guards user names"
        " and job ids); make one with: python -c 'import secrets;"
        " print(secrets.token_urlsafe(32))'"
    )
if any(c.isspace() for c in GPULAB_METRICS_TOKEN):
    raise ImproperlyConfigured("GPULAB_METRICS_TOKEN must not contain white space")
GPULAB_METRICS_ALLOWED_NETWORKS = envnetworks("GPULAB_METRICS_ALLOWED_NETWORKS")

# The GPU-hours per group are totals PostgreSQL keeps (portal.prometheus.ledger):
# each usage record's change is appended as a delta, folded in at each scrape and,
# so the deltas stay few when nothing scrapes (the export off), by beat this often
# (seconds).
GPULAB_METRICS_FOLD_INTERVAL = envfloat(
    "GPULAB_METRICS_FOLD_INTERVAL", 600.0, minimum=10.0
)
METRICS_BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "metrics-fold": {
        "task": "portal.prometheus.tasks.fold",
        "schedule": GPULAB_METRICS_FOLD_INTERVAL,
        "options": {"expires": GPULAB_METRICS_FOLD_INTERVAL},
    }
}
