"""Durations and amounts as people write them ("4h", "12G"): the one parser of
the submit form and the ``gpulab`` command line. Pure: no Django (the command
line imports it)."""

from __future__ import annotations

import re

# ASCII digits only (str.isdigit() and \d accept other scripts' digits, which
# int() refuses or reads), at most 12 of them: no number too large for int()
# or float(), and any larger amount is refused by the service's limits anyway.
_N = "[0-9]{1,12}"
_DURATION_RE = re.compile(
    rf"(?:(?P<d>{_N})d)?\s*(?:(?P<h>{_N})h)?\s*(?:(?P<m>{_N})m)?\s*(?:(?P<s>{_N})s)?"
)
_CLOCK_RE = re.compile(rf"({_N}):([0-9]{{1,2}}):([0-9]{{1,2}})")
_MINUTES_RE = re.compile(_N)
_MEMORY_RE = re.compile(
    rf"(?P<n>{_N}(?:\.[0-9]{{1,12}})?)\s*(?P<unit>[MG]i?B?|[MG])?", re.I
)

DURATION_HELP = "Write a duration like 4h, 90m, 1d12h or 02:30:00."
MEMORY_HELP = "Write an amount like 12G, 16GiB or 2048M."


def parse_duration(text: str) -> int | None:
    """'4h', '1d12h', '90m', '2h30m', '3600s', 'HH:MM:SS' or bare minutes ->
    seconds; None for empty text; ``ValueError`` (``DURATION_HELP``) else."""
    text = text.strip().lower()
    if not text:
        return None
    if _MINUTES_RE.fullmatch(text):
        return int(text) * 60
    if clock := _CLOCK_RE.fullmatch(text):
        h, m, s = (int(p) for p in clock.groups())
        return h * 3600 + m * 60 + s
    match = _DURATION_RE.fullmatch(text)
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
    match = _MEMORY_RE.fullmatch(text)
    if not match:
        raise ValueError(MEMORY_HELP)
    number = float(match.group("n"))
    unit = (match.group("unit") or "M").upper()
    mib = number * 1024 if unit.startswith("G") else number
    return max(1, round(mib))
