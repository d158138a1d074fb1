"""GPULAB_WORKDIR_ALLOWED: absolute directories, normalised; a bad value stops the
start with a message naming the variable."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from portal.settings_input import _workdir_prefixes

VAR = "GPULAB_WORKDIR_ALLOWED"
DEFAULT = ["/home", "/tmp"]


@pytest.mark.parametrize(
    ("value", "prefixes"),
    [
        (None, DEFAULT),
        ("/lab, /scratch/", ["/lab", "/scratch"]),
        ("//srv/./x/../y", ["/srv/y"]),
        ("/", ["/"]),
    ],
)
def test_it_reads_normalised_directories(
    monkeypatch: pytest.MonkeyPatch, value: str | None, prefixes: list[str]
) -> None:
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)

    assert _workdir_prefixes(VAR, DEFAULT) == prefixes


@pytest.mark.parametrize("value", ["", " , ", "home", "/tmp,scratch"])
def test_a_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(VAR, value)

    with pytest.raises(ImproperlyConfigured, match=VAR):
        _workdir_prefixes(VAR, DEFAULT)
