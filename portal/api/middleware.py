"""Keeps every response under ``/api/`` JSON with the one error body, also for
what happens outside a view: a body over ``GPULAB_API_MAX_BODY_BYTES`` (413,
refused before anything reads it), more query parameters than Django reads
(``DATA_UPLOAD_MAX_NUMBER_FIELDS``: 400 naming ``query``, before any view or
authentication parses them), a request Django calls suspicious (400), a path no
view matches (404), an unhandled exception (500, logged with its traceback, no
details sent).

Two layers share the size rule (``size_refusal``): ``BodyLimit`` wraps the
ASGI application (``portal/asgi.py``), because Django's ASGI handler reads the
whole body (spooling it to disk) before any Django middleware runs, and a
chunked body has no Content-Length to check; ``ApiErrorMiddleware`` holds the
same line for WSGI (the test client, a WSGI deployment)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import SuspiciousOperation, TooManyFieldsSent
from django.http import HttpRequest, HttpResponse, JsonResponse

from portal.api.errors import body
from portal.views.errors import database_down, unavailable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    # as Django's ASGIHandler declares them
    Scope = dict[str, Any]
    Message = Mapping[str, Any]
    Receive = Callable[[], Awaitable[Message]]
    Send = Callable[[Message], Awaitable[None]]
    AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("portal.api")

PREFIX = "/api/"


def size_refusal(content_length: str | None) -> tuple[int, dict[str, Any]] | None:
    """The status and error body for a declared length that is refused (not a
    number: 400; over the limit: 413), or None."""
    limit = settings.GPULAB_API_MAX_BODY_BYTES
    try:
        size = int(content_length or "0")
    except ValueError:
        return 400, body("parse_error", "Content-Length is not a number.")
    if size > limit:
        return 413, _too_large(f"The request body is {size} bytes", limit)
    return None


def query_refusal(request: HttpRequest) -> dict[str, Any] | None:
    """The error body for a query string with more parameters than Django
    reads, or None. Parsing ``request.GET`` here, once, is what any later
    reader gets: nothing after this can meet ``TooManyFieldsSent``."""
    try:
        request.GET  # parsed on first access
    except TooManyFieldsSent:
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
        message = f"More than {limit} query parameters; send at most {limit}."
        return body("invalid", message, {"query": [message]})
    return None


def _too_large(what: str, limit: int) -> dict[str, Any]:
    return body("too_large", f"{what}; the limit is {limit} bytes.")


class BodyLimit:
    """ASGI: refuse an API request whose body is over the limit before it is
    read: by its Content-Length at once, else (chunked) as soon as the bytes
    received pass it. A body within the limit is handed on whole, with its
    Content-Length set, so that a chunked request is parsed like any other."""

    def __init__(self, app: AsgiApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        declared = next(
            (v for k, v in scope["headers"] if k == b"content-length"), None
        )
        refused = size_refusal(declared.decode("latin-1") if declared else None)
        if refused is not None:
            await _respond(send, *refused)
            return
        limit = settings.GPULAB_API_MAX_BODY_BYTES
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app sees it
            size += len(message.get("body", b""))
            if size > limit:
                await _respond(
                    send, 413, _too_large("The request body is too large", limit)
                )
                return
            if not message.get("more_body", False):
                break
        body_bytes = b"".join(m.get("body", b"") for m in messages)
        whole: list[Message] = (
            [{"type": "http.request", "body": body_bytes, "more_body": False}]
            if messages and messages[-1]["type"] == "http.request"
            else messages
        )

        async def replay() -> Message:
            if whole:
                return whole.pop(0)
            return await receive()  # after the body: the disconnect, when it comes

        headers.append((b"content-length", str(size).encode()))
        await self.app({**scope, "headers": headers}, replay, send)


async def _respond(send: Send, status: int, data: dict[str, Any]) -> None:
    payload = json.dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class ApiErrorMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(PREFIX):
            return self.get_response(request)
        refused = size_refusal(request.META.get("CONTENT_LENGTH"))
        if refused is not None:
            status, error = refused
            return JsonResponse(error, status=status)
        if (bad_query := query_refusal(request)) is not None:
            return JsonResponse(bad_query, status=400)
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
        if database_down(exception):  # a 503 saying so, not a 500
            return unavailable(request, exception)
        if isinstance(exception, SuspiciousOperation):
            # Django's own answer to these is a 400 (logged by django.security,
            # without a traceback): the same, in the API's body.
            log.warning("Refused %s %s: %s", request.method, request.path, exception)
            return JsonResponse(
                body("bad_request", str(exception) or "Bad request."), status=400
            )
        log.exception("API error on %s %s", request.method, request.path)
        return JsonResponse(
            body("server_error", "Internal error; it was logged."), status=500
        )
