"""Template filters of the web UI."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

from django import template
from django.utils.html import conditional_escape, format_html
from django.utils.safestring import SafeString, mark_safe

from agents import jobtext

if TYPE_CHECKING:
    from scheduler.models import Attempt

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


@register.filter
def progress(attempt: Attempt | None) -> str:
    """What the job reported: 'step 1,200 of 5,000 (24%), 3.2 steps/s', or
    'step 1,200, 3.2 steps/s' without a total; '' before any report."""
    if attempt is None or attempt.progress_step is None:
        return ""
    step, total = attempt.progress_step, attempt.progress_total
    text = f"step {step:,}"
    if total is not None:
        text += f" of {total:,}"
        if total > 0:
            text += f" ({step * 100 // total}%)"  # floor: 100% only when done
    rate = attempt.progress_rate()
    if rate is not None:
        text += f", {_rate(rate)} steps/s"
    return text


def _rate(rate: float) -> str:
    if rate >= 100:
        return f"{rate:,.0f}"
    if rate >= 1:
        return f"{rate:.1f}"
    return f"{rate:.2g}"  # 0.05, 0.012: two significant digits


@register.filter
def mib(value: object) -> str:
    """MiB as '512 MiB' or '4.0 GiB' (a dash when unknown)."""
    if not isinstance(value, int | float):
        return "\u2013"
    if value < 1024:
        return f"{value} MiB"
    return f"{value / 1024:.1f} GiB"


@register.filter
def gib(value: object) -> str:
    """MiB as GiB without the unit: '32.1', '80' (whole numbers from 100 up)."""
    if not isinstance(value, int | float):
        return "\u2013"
    gibs = value / 1024
    return f"{gibs:.0f}" if gibs >= 100 or gibs == int(gibs) else f"{gibs:.1f}"


@register.filter
def pct(value: object, total: object) -> int:
    """``value`` as a whole percentage of ``total``, 0 to 100 (0 when unknown)."""
    if not isinstance(value, int | float) or not isinstance(total, int | float):
        return 0
    if not total:
        return 0
    return max(0, min(100, round(value * 100 / total)))


@register.filter
def ago(epoch: float | None) -> str:
    """How long ago an epoch time was, as ``duration`` says it; a dash for None."""
    if epoch is None:
        return "\u2013"
    return duration(max(0.0, time.time() - epoch))


@register.filter
def foreign_summary(processes: list[dict[str, int | None]]) -> str:
    """Foreign processes in a tile's few characters: '2.9 GiB', 'x2 43.0 GiB' (a multiplication sign),
    or 'pid 7' when the memory is unknown (the pids are in the tooltip)."""
    held = sum(p["mib"] or 0 for p in processes)
    count = f"\u00d7{len(processes)} " if len(processes) > 1 else ""
    if held:
        return f"{count}{mib(held)}"
    return count + ", ".join(f"pid {p['pid']}" for p in processes)


@register.filter(needs_autoescape=True)
def visible(value: object, autoescape: bool = True) -> SafeString:  # noqa: FBT001,FBT002
    """Text a user gave, escaped, with each bidirectional control character
    (``agents.jobtext``) shown as a marked ``⟨U+202E⟩`` instead of silently
    reordering what surrounds it (``job\u202egnp.exe`` would read "jobexe.png")."""
    text = "" if value is None else str(value)
    escape = conditional_escape if autoescape else str
    parts: list[str] = []
    last = 0
    for found in jobtext.BIDI_RE.finditer(text):
        ch = found.group()
        parts.append(escape(text[last : found.start()]))
        parts.append(
            format_html(
                '<mark class="bidi" title="invisible bidirectional control'
                ' character {}">{}</mark>',
                jobtext.codepoint(ch),
                jobtext.marker(ch),
            )
        )
        last = found.end()
    parts.append(escape(text[last:]))
    return mark_safe("".join(parts))  # every part is escaped above
