"""Template filters of the web UI."""

from __future__ import annotations

from datetime import timedelta

from django import template

register = template.Library()


@register.filter
def duration(value: int | float | timedelta | None) -> str:
    """Seconds (or a timedelta) as '1d 2h', '4h 30m', '90s'."""
    if value is None:
        return "\u2013"  # en dash
    seconds = int(value.total_seconds() if isinstance(value, timedelta) else value)
    if seconds < 60:
        return f"{seconds}s"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m")]
    if not days and not hours:
        parts.append((secs, "s"))
    text = " ".join(f"{n}{unit}" for n, unit in parts if n)
    return text or "0s"
