"""One error body for every API error:
``{"error": code, "detail": text, "fields": {field: [messages]}}``.

``exception_handler`` (DRF's hook) maps what views and services raise:

| raised | status | error |
| --- | --- | --- |
| DRF ``ValidationError``, Django ``ValidationError`` (a service's rules) | 400 | ``invalid`` |
| ``ParseError`` (bad JSON; nested too deep: the field named) | 400 | ``parse_error`` |
| not authenticated / bad token | 401 | ``not_authenticated`` / ``authentication_failed`` |
| ``PermissionDenied`` (DRF's or Django's) | 403 | ``permission_denied`` |
| ``Http404`` / ``NotFound`` | 404 | ``not_found`` |
| ``MethodNotAllowed`` | 405 | ``method_not_allowed`` |
| ``JobStateError`` (the job's state forbids it) | 409 | ``wrong_state`` |
| ``RequestDataTooBig`` | 413 | ``too_large`` |
| ``UnsupportedMediaType`` | 415 | ``unsupported_media_type`` |
| ``Throttled`` | 429 | ``throttled`` (with ``Retry-After``) |

Anything else is left to ``middleware.ApiErrorMiddleware`` (500 ``server_error``,
and the 404 of a path no view matches), so no API response is HTML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler

from scheduler.services import JobStateError

if TYPE_CHECKING:
    from collections.abc import Mapping


def body(
    code: str, detail: str, fields: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    return {"error": code, "detail": detail, "fields": dict(fields or {})}


def _flatten(detail: Any) -> dict[str, list[str]]:
    """DRF's nested error detail -> {"field": ["message", ...]} ("a.b" for nested)."""
    out: dict[str, list[str]] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(value, list):
            if all(not isinstance(v, (dict, list)) for v in value):
                out.setdefault(prefix or "non_field_errors", []).extend(
                    str(v) for v in value
                )
            else:
                for i, sub in enumerate(value):
                    walk(f"{prefix}.{i}" if prefix else str(i), sub)
        else:
            out.setdefault(prefix or "non_field_errors", []).append(str(value))

    walk("", detail)
    return out


def _summary(fields: Mapping[str, list[str]]) -> str:
    parts = [f"{name}: {msgs[0]}" for name, msgs in fields.items() if msgs]
    return "Invalid input. " + " ".join(parts) if parts else "Invalid input."


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, DjangoValidationError):
        fields = (
            {k: [str(m) for m in v] for k, v in exc.message_dict.items()}
            if hasattr(exc, "error_dict")
            else {"non_field_errors": [str(m) for m in exc.messages]}
        )
        return Response(body("invalid", _summary(fields), fields), status=400)
    if isinstance(exc, JobStateError):
        return Response(body("wrong_state", str(exc)), status=status.HTTP_409_CONFLICT)
    if isinstance(exc, RequestDataTooBig):
        return Response(body("too_large", "The request body is too large."), status=413)
    if isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or None)
    response = drf_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        fields = _flatten(exc.detail)
        response.data = body("invalid", _summary(fields), fields)
        return response
    if isinstance(exc, exceptions.APIException):
        detail = exc.detail
        text = (
            str(detail)
            if not isinstance(detail, (dict, list))
            else _summary(_flatten(detail))
        )
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else exc.default_code
        if isinstance(exc, exceptions.Throttled):
            code = "throttled"
            wait = getattr(exc, "wait", None)
            text = (
                f"Too many requests; try again in {int(wait)} s."
                if wait is not None
                else "Too many requests."
            )
        # a parse error may name where (parsers.TooDeep)
        response.data = body(str(code), text, getattr(exc, "fields", None))
    return response
