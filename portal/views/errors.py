"""Error pages. A database that cannot be reached is a 503 ("try again shortly",
with ``Retry-After``), never a 500 with a traceback: the request changed nothing,
and the web process reconnects by itself once PostgreSQL is back
(``CONN_HEALTH_CHECKS`` drops a dead connection at the start of a request)."""

from __future__ import annotations

import logging
import sys

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.views.defaults import server_error as default_server_error

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
UNAVAILABLE = "The database is unavailable; nothing was changed. Try again shortly."


def wants_json(request: HttpRequest) -> bool:
    """API clients (``/api/``, or asking for JSON) get JSON errors."""
    accept = request.headers.get("Accept", "")
    return request.path.startswith("/api/") or (
        "application/json" in accept and "text/html" not in accept
    )


def database_down(exc: BaseException | None) -> bool:
    return isinstance(exc, OperationalError | InterfaceError)


def unavailable(request: HttpRequest, exc: BaseException) -> HttpResponse:
    """The 503: JSON in the API's one error body for API clients, else a page
    rendered without the request's context (its processors would ask the
    database, for the user, again)."""
    log.warning("database unavailable for %s %s: %s", request.method, request.path, exc)
    response: HttpResponse
    if wants_json(request):
        response = JsonResponse(
            {"error": "unavailable", "detail": UNAVAILABLE, "fields": {}}, status=503
        )
    else:
        response = HttpResponse(
            render_to_string("503.html", {"message": UNAVAILABLE}), status=503
        )
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def server_error(request: HttpRequest) -> HttpResponse:
    """``handler500``: 503 when the uncaught exception is the database being
    unreachable (it is still the one being handled here), else Django's 500."""
    exc = sys.exc_info()[1]
    if exc is None or not database_down(exc):
        return default_server_error(request)
    return unavailable(request, exc)
