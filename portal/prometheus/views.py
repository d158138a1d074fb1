"""``/metrics``: the access check and the scrape.

Access (``portal/settings_metrics.py``): with neither ``GPULAB_METRICS_TOKEN``
nor ``GPULAB_METRICS_ALLOWED_NETWORKS`` set the export is off (404, the body says
which settings turn it on); with a token, a request without ``Authorization:
Bearer <token>`` gets 401; with networks, a client outside them gets 403; with
both, both are needed. No session or login is involved: Prometheus has none.
"""

from __future__ import annotations

import hmac
import logging
from ipaddress import ip_address
from typing import TYPE_CHECKING

import redis
from django.conf import settings
from django.db import DatabaseError
from django.http import HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from portal.prometheus.collector import GpulabCollector

if TYPE_CHECKING:
    from django.http import HttpRequest

log = logging.getLogger(__name__)

# The classic text format, which every Prometheus 2.x reads (the names are plain
# ASCII: no escaping needed).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

OFF = (
    "The metrics export is off. Set GPULAB_METRICS_TOKEN (a bearer token the"
    " scraper sends) and/or GPULAB_METRICS_ALLOWED_NETWORKS (the scrapers' CIDRs)"
    " to turn it on (docs/admin-guide.md, 'Prometheus and Grafana').\n"
)


def _text(body: str, status: int) -> HttpResponse:
    return HttpResponse(body, status=status, content_type="text/plain; charset=utf-8")


def refusal(request: HttpRequest) -> HttpResponse | None:
    """Why ``request`` may not scrape (the response to send), or None."""
    token: str = settings.GPULAB_METRICS_TOKEN
    networks = settings.GPULAB_METRICS_ALLOWED_NETWORKS
    if not token and not networks:
        return _text(OFF, 404)
    if networks:
        try:
            client = ip_address(request.META.get("REMOTE_ADDR", ""))
        except ValueError:
            client = None
        if client is None or not any(client in net for net in networks):
            return _text(
                f"{request.META.get('REMOTE_ADDR', '?')} may not read the metrics:"
                " its address is outside GPULAB_METRICS_ALLOWED_NETWORKS.\n",
                403,
            )
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            response = _text(
                "The metrics need 'Authorization: Bearer <GPULAB_METRICS_TOKEN>'"
                " (a missing or wrong token).\n",
                401,
            )
            response["WWW-Authenticate"] = 'Bearer realm="gpulab metrics"'
            return response
    return None


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Every gpulab metric in Prometheus' text format, read now from PostgreSQL
    and Redis (a registry made for this scrape)."""
    refused = refusal(request)
    if refused is not None:
        return refused
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpulabCollector())
    try:
        body = generate_latest(registry)
    except (DatabaseError, redis.RedisError) as exc:
        # Prometheus records the target as down; the log names the cause.
        log.warning("metrics scrape failed: %r", exc)
        what = "Redis" if isinstance(exc, redis.RedisError) else "PostgreSQL"
        response = _text(f"The metrics cannot be read now: {what} is away.\n", 503)
        response["Retry-After"] = "15"
        return response
    return HttpResponse(body, content_type=CONTENT_TYPE)
