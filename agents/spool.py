"""Sequence numbers and the spool of durable frames (kept on disk until acked).

- ``SeqCounter``: ``seq`` grows for the life of the node, across restarts. It leases
  blocks of numbers in ``agent.json`` (one fsynced write per ``LEASE`` frames), so a
  restarted agent starts above anything it may have sent; gaps are fine.
- ``Spool``: ``spool.jsonl`` holds one envelope a line, appended and fsynced before the
  frame is sent; acked frames are dropped by rewriting the file atomically.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from agents.statedir import atomic_write, read_text

if TYPE_CHECKING:
    from pathlib import Path

LEASE = 1000


class SeqCounter:
    def __init__(self, path: Path, floor: int = 0) -> None:
        self.path = path
        self.state: dict[str, Any] = {}
        text = read_text(path)
        if text:
            try:
                self.state = json.loads(text)
            except ValueError:
                self.state = {}
        self.lease = int(self.state.get("seq_lease", 0))
        self.next = max(self.lease, floor + 1, 1)

    def take(self) -> int:
        if self.next >= self.lease:
            self.lease = self.next + LEASE
            self.state["seq_lease"] = self.lease
            atomic_write(self.path, json.dumps(self.state) + "\n")
        seq = self.next
        self.next += 1
        return seq


class Spool:
    """Durable frames by seq, in seq order, mirrored in ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[int, str] = {}
        text = read_text(path) or ""
        for line in text.splitlines():
            try:
                seq = int(json.loads(line)["seq"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a crash mid-append
            self.entries[seq] = line
        self.entries = dict(sorted(self.entries.items()))
        # Rewrite now so a torn line never sits in front of new appends.
        self._rewrite()

    @property
    def max_seq(self) -> int:
        return max(self.entries, default=0)

    def append(self, seq: int, frame: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, frame.encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        self.entries[seq] = frame

    def pending(self, after: int = 0) -> list[tuple[int, str]]:
        return [(s, f) for s, f in self.entries.items() if s > after]

    def remove(self, seqs: list[int]) -> list[dict[str, Any]]:
        """Drop acked frames; returns them parsed."""
        gone = [json.loads(self.entries.pop(s)) for s in seqs if s in self.entries]
        if gone:
            self._rewrite()
        return gone

    def _rewrite(self) -> None:
        atomic_write(self.path, "".join(f + "\n" for f in self.entries.values()))
