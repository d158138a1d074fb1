"""What text a job may carry and how it is shown, one copy for every layer.

Pure (``re`` only): the portal's validation (``scheduler.services.jobs``), its pages
and notifications, the ``gpulab`` command line (which imports no Django) and the
agent's launch checks all read these rules.

- A working directory is normalised lexically (``normal_workdir``) before it is
  checked, stored, shown and entered.
- An environment variable name is a shell identifier, ``[A-Za-z_][A-Za-z0-9_]*``
  in full: ``/bin/sh`` silently drops any other name from the job's environment.
- Bidirectional control characters (U+202A-202E, U+2066-2069, U+200E, U+200F,
  U+061C) reorder the text around them without being seen, so ``job\\u202egnp.exe``
  reads as "jobexe.png". They are refused in labels gpulab itself shows (names,
  workload labels) and marked visibly, as ``⟨U+202E⟩``, wherever text that runs
  verbatim (commands, environment values, working directories) is shown.
"""

from __future__ import annotations

import posixpath
import re

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f"
    + "".join(map(chr, range(0x202A, 0x202F)))
    + "".join(map(chr, range(0x2066, 0x206A)))
)
BIDI_RE = re.compile("[" + "".join(sorted(BIDI_CONTROLS)) + "]")
# What a terminal would act on instead of printing: every C0/C1 control but tab
# and newline (a CR alone returns to the line's start and can hide what precedes).
_TERMINAL_RE = re.compile(
    "[" + "".join(sorted(BIDI_CONTROLS)) + r"\x00-\x08\x0b-\x1f\x7f-\x9f]"
)


def is_env_name(name: str) -> bool:
    """Whether ``name`` is a name ``/bin/sh`` keeps in the environment."""
    return ENV_NAME_RE.fullmatch(name) is not None


def normal_workdir(workdir: str) -> str:
    """The path a job runs in and is shown with: ``.``, ``..`` and repeated
    slashes resolved lexically (``/tmp/../../etc`` is ``/etc``), so what the
    portal checks and shows is the directory the agent enters, whatever symlinks
    a ``..`` would otherwise climb out of."""
    path = posixpath.normpath(workdir)
    return "/" + path.lstrip("/") if path.startswith("/") else path


def codepoint(ch: str) -> str:
    """``U+202E``."""
    return f"U+{ord(ch):04X}"


def marker(ch: str) -> str:
    """The visible stand-in of an invisible character: ``⟨U+202E⟩``."""
    return f"\u27e8{codepoint(ch)}\u27e9"


def first_bidi(text: str) -> str | None:
    """The first bidirectional control character in ``text``, or None."""
    found = BIDI_RE.search(text)
    return found.group() if found else None


def mark_bidi(text: str) -> str:
    """``text`` with each bidirectional control character replaced by its marker."""
    return BIDI_RE.sub(lambda m: marker(m.group()), text)


def for_terminal(text: str) -> str:
    """``text`` safe to print on a terminal: bidirectional controls and the control
    characters a terminal would act on (escape sequences, a lone CR) become
    markers; CRLF line ends become LF; tabs and newlines stay."""
    return _TERMINAL_RE.sub(lambda m: marker(m.group()), text.replace("\r\n", "\n"))
