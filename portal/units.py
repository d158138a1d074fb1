"""Durations and amounts as people write them ("4h", "12G"): the one parser of
the submit form and the ``gpulab`` command line. Pure: no Django (the command
line imports it)."""

from __future__ import annotations

import re

_DURATION_RE = re.compile(
    r"^(?:(?P<d>\d+)d)?\s*(?:(?P<h>\d+)h)?\s*(?:(?P<m>\d+)m)?\s*(?:(?P<s>\d+)s)?$"
)
_MEMORY_RE = re.compile(r"^(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[MG]i?B?|[MG])?$", re.I)

DURATION_HELP = "Write a duration like 4h, 90m, 1d12h or 02:30:00."
MEMORY_HELP = "Write an amount like 12G, 16GiB or 2048M."


def parse_duration(text: str) -> int | None:
    """'4h', '1d12h', '90m', '2h30m', '3600s', 'HH:MM:SS' or bare minutes ->
    seconds; None for empty text; ``ValueError`` (``DURATION_HELP``) else."""
    text = text.strip().lower()
    if not text:
        return None
    if text.isdigit():
        return int(text) * 60
    if re.fullmatch(r"\d+:\d{1,2}:\d{1,2}", text):
        h, m, s = (int(p) for p in text.split(":"))
        return h * 3600 + m * 60 + s
    match = _DURATION_RE.match(text)
    if not match or not any(match.groupdict().values()):
        raise ValueError(DURATION_HELP)
    parts = {k: int(v or 0) for k, v in match.groupdict().items()}
    return parts["d"] * 86400 + parts["h"] * 3600 + parts["m"] * 60 + parts["s"]


def format_duration(seconds: int) -> str:
    """The exact inverse of ``parse_duration``: 5400 -> '1h30m', 90061 -> '1d1h1m1s'."""
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def parse_memory_mib(text: str) -> int | None:
    """'12G', '12GB', '16GiB', '512M', '2048' (MiB) -> MiB; None for empty text;
    ``ValueError`` (``MEMORY_HELP``) else."""
    text = text.strip()
    if not text:
        return None
    match = _MEMORY_RE.match(text)
    if not match:
        raise ValueError(MEMORY_HELP)
    number = float(match.group("n"))
    unit = (match.group("unit") or "M").upper()
    mib = number * 1024 if unit.startswith("G") else number
    return max(1, round(mib))
