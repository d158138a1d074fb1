"""The API's JSON renderer (portal/api/renderers.py): a long list is encoded one
item at a time (so the web process's other threads get the GIL between items),
and the bytes are exactly DRF's."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pytest
from rest_framework import renderers as drf
from rest_framework.settings import api_settings
from rest_framework.utils.encoders import JSONEncoder

from portal.api.renderers import PIECEWISE_ITEMS, JSONRenderer


def job(n: int) -> dict[str, Any]:
    return {
        "id": n,
        "name": f"job-{n} é 漢 \u2028 line",
        "command": 'python -c "print(1)"\n\t\\',
        "gpus": n % 8,
        "progress": n / 7,
        "held": n % 2 == 0,
        "ended_at": None,
        "nodes": ["n1", "n2"][: n % 3],
        "env": {"A": "1", "B": ""},
    }


CASES: list[Any] = [
    [job(n) for n in range(PIECEWISE_ITEMS + 150)],
    {
        "count": 12_500,
        "next": "http://x/api/v1/jobs/?limit=200&offset=200",
        "previous": None,
        "results": [job(n) for n in range(200)],
    },
    [job(n) for n in range(3)],  # short: whole
    [],
    {},
    {"results": []},
    {1: [job(n) for n in range(100)]},  # not a string key: DRF's way
    {"outer": {"inner": [job(n) for n in range(100)]}},  # deeper than we look
    [[n, str(n)] for n in range(500)],
    ("a", "b", *["c"] * 100),
]


@pytest.mark.parametrize("data", CASES)
@pytest.mark.parametrize(
    "media", [None, "application/json", "application/json; indent=2"]
)
def test_the_bytes_are_exactly_drfs(data: Any, media: str | None) -> None:
    assert JSONRenderer().render(data, media, {}) == drf.JSONRenderer().render(
        data, media, {}
    )


class CountingEncoder(JSONEncoder):
    sizes: ClassVar[list[int]] = []

    def encode(self, o: Any) -> str:
        text = super().encode(o)
        self.sizes.append(len(text))
        return text


def test_a_long_list_is_encoded_one_item_at_a_time() -> None:
    """No single call of the C encoder covers more than one job of the page."""
    page = {"count": 1000, "results": [job(n) for n in range(1000)]}

    class Counting(JSONRenderer):
        encoder_class = CountingEncoder

    renderer = Counting()
    CountingEncoder.sizes = []
    body = renderer.render(page, "application/json", {})
    one = max(len(drf.JSONRenderer().render(job(n))) for n in range(1000))
    assert len(CountingEncoder.sizes) > 1000
    assert max(CountingEncoder.sizes) <= one
    assert len(body) > 1000 * one // 2


def test_not_a_number_is_refused_as_drf_refuses_it() -> None:
    data = [{"x": 1.0}] * 100 + [{"x": math.nan}]
    with pytest.raises(ValueError, match="Out of range float values"):
        drf.JSONRenderer().render(data)
    with pytest.raises(ValueError, match="Out of range float values"):
        JSONRenderer().render(data)


def test_the_api_renders_json_with_it() -> None:
    first: object = api_settings.DEFAULT_RENDERER_CLASSES[0]
    assert first is JSONRenderer
