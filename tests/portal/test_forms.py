"""The form's text parsers: durations and GPU memory."""

from __future__ import annotations

import pytest
from django import forms

from portal.forms import parse_duration, parse_env, parse_memory_mib


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("4h", 4 * 3600),
        ("90m", 90 * 60),
        ("1d12h", 36 * 3600),
        ("2h30m", 2 * 3600 + 30 * 60),
        ("3600s", 3600),
        ("1d 2h 3m 4s", 86400 + 7200 + 180 + 4),
        ("02:30:00", 2 * 3600 + 30 * 60),
        ("0:00:45", 45),
        ("30", 30 * 60),
        ("  4H ", 4 * 3600),
        ("", None),
        ("   ", None),
    ],
)
def test_it_parses_durations(text: str, seconds: int | None) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["soon", "4 hours", "h", "1.5h", "-4h", "4h4h", "12:00", "1:2:3:4", "4x"]
)
def test_it_refuses_bad_durations(text: str) -> None:
    with pytest.raises(forms.ValidationError, match="Write a duration like 4h"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("12G", 12 * 1024),
        ("12GB", 12 * 1024),
        ("16GiB", 16 * 1024),
        ("16gib", 16 * 1024),
        ("1.5G", 1536),
        ("512M", 512),
        ("512MiB", 512),
        ("2048", 2048),
        ("40 G", 40 * 1024),
        ("", None),
    ],
)
def test_it_parses_memory(text: str, mib: int | None) -> None:
    assert parse_memory_mib(text) == mib


@pytest.mark.parametrize("text", ["lots", "12T", "G", "-5G", "12 GB extra", "1,5G"])
def test_it_refuses_bad_memory(text: str) -> None:
    with pytest.raises(forms.ValidationError, match="Write an amount like 12G"):
        parse_memory_mib(text)


def test_it_parses_env_lines_keeping_equals_in_values() -> None:
    env = parse_env("A=1\n\n# note\n B=x=y \n")

    assert env == {"A": "1", "B": "x=y"}


def test_it_names_the_bad_env_line() -> None:
    with pytest.raises(forms.ValidationError, match="Line 2: write KEY=VALUE"):
        parse_env("A=1\nnot a pair")


@pytest.mark.parametrize(
    "seconds", [0, 59, 60, 5400, 5401, 86400, 90061, 3 * 86400 + 7]
)
def test_format_duration_is_the_exact_inverse_of_parse_duration(seconds: int) -> None:
    from portal.forms import format_duration

    text = format_duration(seconds)

    assert parse_duration(text) == seconds
