"""Keeps every response under ``/api/`` JSON with the one error body, also for
what happens outside a view: a body over ``GPULAB_API_MAX_BODY_BYTES`` (413,
refused before anything reads it), a path no view matches (404), an unhandled
exception (500, logged with its traceback, no details sent)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from portal.api.errors import body

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("portal.api")

PREFIX = "/api/"


class ApiErrorMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(PREFIX):
            return self.get_response(request)
        limit = settings.GPULAB_API_MAX_BODY_BYTES
        length = request.META.get("CONTENT_LENGTH") or "0"
        try:
            size = int(length)
        except ValueError:
            return JsonResponse(
                body("parse_error", "Content-Length is not a number."), status=400
            )
        if size > limit:
            return JsonResponse(
                body(
                    "too_large",
                    f"The request body is {size} bytes; the limit is {limit} bytes.",
                ),
                status=413,
            )
        response = self.get_response(request)
        if response.status_code == 404 and not response.get(
            "Content-Type", ""
        ).startswith("application/json"):
            return JsonResponse(
                body("not_found", f"No API endpoint at {request.path}."), status=404
            )
        return response

    def process_exception(
        self, request: HttpRequest, exception: Exception
    ) -> HttpResponse | None:
        if not request.path.startswith(PREFIX):
            return None
        log.exception("API error on %s %s", request.method, request.path)
        return JsonResponse(
            body("server_error", "Internal error; it was logged."), status=500
        )
