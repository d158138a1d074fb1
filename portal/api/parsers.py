"""The API's JSON parser: DRF's, with a bound on nesting.

Python's ``json`` recurses once per level; a body of a few kilobytes of ``[``
(well under ``GPULAB_API_MAX_BODY_BYTES``) reaches the interpreter's recursion
limit in the parser, or later in anything that walks the data. No request of
this API nests deeper than three levels, so a body deeper than ``MAX_DEPTH``
is refused (400 ``parse_error`` naming the top-level field it is in) before it
is parsed, by one scan that does not recurse."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from rest_framework import exceptions, parsers

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import IO

MAX_DEPTH = 32

# A JSON string (with its escapes) or one bracket; everything else is skipped.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_COLON = re.compile(r"\s*:")


class TooDeep(exceptions.ParseError):
    """A body nested deeper than ``MAX_DEPTH``; ``fields`` names where."""

    def __init__(self, field: str) -> None:
        message = f"Nested deeper than {MAX_DEPTH} levels."
        self.fields = {field: [message]}
        super().__init__(
            f"The JSON body is nested deeper than {MAX_DEPTH} levels (in {field})."
        )


def too_deep_at(text: str, limit: int = MAX_DEPTH) -> str | None:
    """Where ``text`` first nests deeper than ``limit``: the top-level key it is
    under, or ``"body"`` (outside a top-level object); None when it does not.
    Brackets inside strings do not count."""
    depth = 0
    top_is_object = False
    key = "body"
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth == 1:
                top_is_object = token == "{"
            elif depth > limit:
                return key if top_is_object else "body"
        elif token in "]}":
            depth -= 1
        elif depth == 1 and top_is_object and _COLON.match(text, match.end()):
            key = _key(token)
    return None


def _key(token: str) -> str:
    try:
        key = json.loads(token)
    except ValueError:
        key = token[1:-1]
    return str(key)[:100]


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


class JSONParser(parsers.JSONParser):
    def parse(
        self,
        stream: IO[Any] | None,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        if stream is None:
            return None
        encoding = (parser_context or {}).get("encoding", "utf-8")
        try:
            text = stream.read().decode(encoding)
        except UnicodeDecodeError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        field = too_deep_at(text)
        if field is not None:
            raise TooDeep(field)
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
