"""The API's JSON renderer: DRF's, encoding a big list one item at a time.

``json.dumps`` encodes in C and holds the GIL from start to end: a page of 1,000
jobs (about 860 KB) takes tens of milliseconds, during which every other thread
of the web process waits (another user's short call, the event loop serving
everyone). Encoded one list item at a time, with Python code between the
pieces, the interpreter can hand the GIL on between items every switch interval
(``portal/gate.py``). The bytes are exactly DRF's: a compact list is ``[``, its
items' encodings joined by ``,``, then ``]``, and an object likewise."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rest_framework import renderers

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from json import JSONEncoder

# A list longer than this is encoded item by item (a short one is quicker whole).
PIECEWISE_ITEMS = 50
# How deep to look for such a list: a page of jobs is {"results": [...]}.
PIECEWISE_DEPTH = 2


class JSONRenderer(renderers.JSONRenderer):
    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Mapping[str, Any] | None = None,
    ) -> bytes:
        indent = self.get_indent(accepted_media_type or "", renderer_context or {})
        if indent is not None or not self.compact or not _has_long_list(data):
            whole: bytes = super().render(data, accepted_media_type, renderer_context)
            return whole
        encoder = self.encoder_class(
            ensure_ascii=self.ensure_ascii,
            allow_nan=not self.strict,
            separators=(",", ":"),
        )
        text = "".join(_pieces(data, encoder, PIECEWISE_DEPTH))
        # as DRF: \u2028 and \u2029 escaped, so the output is a JavaScript subset
        text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
        return text.encode()


def _has_long_list(value: Any, depth: int = PIECEWISE_DEPTH) -> bool:
    if isinstance(value, list | tuple):
        return len(value) > PIECEWISE_ITEMS
    if isinstance(value, dict) and depth > 1:
        return all(isinstance(k, str) for k in value) and any(
            _has_long_list(v, depth - 1) for v in value.values()
        )
    return False


def _pieces(value: Any, encoder: JSONEncoder, depth: int) -> Iterator[str]:
    """``value``'s compact JSON in pieces: a long list (at most ``depth`` levels
    down, through objects with string keys) item by item, the rest whole."""
    if not _has_long_list(value, depth):
        yield encoder.encode(value)
    elif isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield f"{',' if i else ''}{encoder.encode(key)}:"
            yield from _pieces(item, encoder, depth - 1)
        yield "}"
    else:
        yield "["
        for i, item in enumerate(value):
            yield f",{encoder.encode(item)}" if i else encoder.encode(item)
        yield "]"
