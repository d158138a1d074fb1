"""Progress a job reports in its output: ``GPULAB_PROGRESS <step>[/<total>]`` lines.

A training script prints, on stdout or stderr, a line of exactly this form::

    GPULAB_PROGRESS 1200
    GPULAB_PROGRESS 1200/5000

``step`` and ``total`` are non-negative integers (ASCII digits, at most
``MAX_VALUE``, PostgreSQL's bigint); spaces or tabs may surround the line. The
portal compares a job's steps per second alone and on a shared GPU, so the
scheduler can tell whether sharing pays. A line that starts with the word
``GPULAB_PROGRESS`` but does not have this form is ignored; the agent warns about the
first such line of a job only (``ProgressTracker.feed`` returns it once).

``ProgressTracker`` (one per job) reads the job's output as the agent ships it, keeps
the latest reading and says when to send it: at most one ``job.progress`` per
``INTERVAL_S`` (the latest value wins), and a last one when the job ends. It takes
its clocks as arguments (no sleeping, no wall clock inside), so tests drive it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

PREFIX: Final = "GPULAB_PROGRESS"
MAX_VALUE: Final = 2**63 - 1
INTERVAL_S: Final = 10.0
# Longest line kept while waiting for its end: a progress line is far shorter, so a
# longer one is skipped up to its line break instead of growing the buffer.
MAX_LINE_CHARS: Final = 256

_LINE = re.compile(r"GPULAB_PROGRESS[ \t]+([0-9]{1,19})(?:/([0-9]{1,19}))?")
_BREAKS = re.compile(r"[\r\n]")


class MalformedProgressError(ValueError):
    """A line that starts with ``GPULAB_PROGRESS`` but is not a progress report."""


@dataclass(frozen=True)
class Reading:
    """One report: ``at`` is the wall-clock time the agent read the line."""

    step: int
    total: int | None
    at: float


def parse_line(line: str) -> tuple[int, int | None] | None:
    """``(step, total)`` of a progress line, None for any other line.

    Raises ``MalformedProgressError`` for a line whose first word is
    ``GPULAB_PROGRESS`` but whose rest is not ``<step>`` or ``<step>/<total>``.
    """
    text = line.strip(" \t\r\n")
    if not text.startswith(PREFIX):
        return None
    rest = text[len(PREFIX) :]
    if rest and (rest[0].isalnum() or rest[0] == "_"):
        return None  # a longer word (GPULAB_PROGRESS_BAR...), not ours
    match = _LINE.fullmatch(text)
    if match is None:
        raise MalformedProgressError(text[:200])
    step = int(match.group(1))
    total = None if match.group(2) is None else int(match.group(2))
    if step > MAX_VALUE or (total is not None and total > MAX_VALUE):
        raise MalformedProgressError(text[:200])
    return step, total


class ProgressTracker:
    """The progress of one job, fed with its output text in order."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.latest: Reading | None = None
        self._unsent = False
        self._sent_at: float | None = None  # monotonic time of the last send
        # The current line so far; None while skipping an over-long line.
        self._partial: str | None = ""
        self._warned = False

    def feed(self, text: str, at: float) -> str | None:
        """Read more of the job's output (read at wall-clock time ``at``).

        Returns the job's first malformed progress line, once (the caller warns);
        later ones, and every other line, return None.
        """
        if self._partial is None:  # skipping the rest of an over-long line
            end = _BREAKS.search(text)
            if end is None:
                return None
            text = text[end.end() :]
            self._partial = ""
        data = self._partial + text
        last = max(data.rfind("\n"), data.rfind("\r"))
        tail = data[last + 1 :]
        self._partial = tail if len(tail) <= MAX_LINE_CHARS else None
        if last < 0:
            return None
        complete = data[:last]
        if PREFIX not in complete:  # the usual case: spare the split
            return None
        bad = None
        for line in _BREAKS.split(complete):
            bad = self._line(line, at) or bad
        return bad

    def finish(self, at: float) -> str | None:
        """The job ended: its last line counts even without a line break."""
        bad = None
        if self._partial:
            bad = self._line(self._partial, at)
        self._partial = ""
        return bad

    def _line(self, line: str, at: float) -> str | None:
        if PREFIX not in line:
            return None
        try:
            parsed = parse_line(line)
        except MalformedProgressError as exc:
            if self._warned:
                return None
            self._warned = True
            return str(exc)
        if parsed is not None:
            self.latest = Reading(parsed[0], parsed[1], at)
            self._unsent = True
        return None

    def take(self, now: float, *, final: bool = False) -> Reading | None:
        """The reading to send now, if any: a new one once ``interval_s`` (monotonic
        ``now``) has passed since the last send; with ``final``, whatever is new."""
        if not self._unsent or self.latest is None:
            return None
        if (
            not final
            and self._sent_at is not None
            and now - self._sent_at < self.interval_s
        ):
            return None
        self._unsent = False
        self._sent_at = now
        return self.latest
