"""Sequence numbers and the spool of durable frames (kept on disk until acked).

- ``SeqCounter``: ``seq`` grows for the life of the node, across restarts. It leases
  blocks of numbers in ``agent.json`` (one fsynced write per ``LEASE`` frames), so a
  restarted agent starts above anything it may have sent; gaps are fine.
- ``Spool``: ``spool.jsonl`` holds one envelope a line, appended and fsynced before the
  frame is sent; ``spool.jsonl.acked`` lists acked seqs until the next compaction.
  Metric samples (spooled only while disconnected) and job progress reports are the
  only frames dropped when the spool reaches its size cap, oldest first
  (``protocol.DROPPABLE_TYPES``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from agents.protocol import DROPPABLE_TYPES
from agents.statedir import atomic_write, read_text

if TYPE_CHECKING:
    from pathlib import Path

log = logging.getLogger(__name__)

LEASE = 1000
# Below this many acked bytes in the file, acks are appended to ``.acked`` rather than
# rewriting the spool (unless it became empty).
COMPACT_MIN_BYTES = 256 * 1024


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
    """Durable frames by seq, in seq order, mirrored in ``path``.

    - Appends are fsynced before the frame is sent.
    - Acked frames leave memory at once; on disk their seqs are appended to
      ``<path>.acked`` (no fsync: a lost line only means a replay the server
      de-duplicates), and the file is compacted (rewritten atomically) when it is
      empty or mostly acked, so a long replay costs no rewrite per ack.
    - ``max_bytes`` caps the file: to make room the oldest *droppable* frames
      (metric samples, progress reports) go first, down to 90 % of the cap so one
      rewrite makes room for many appends; a droppable frame that still does not fit
      is not stored. Job lifecycle and log frames are never dropped (they may exceed
      the cap).
    """

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path = path
        self.acked_path = path.with_name(path.name + ".acked")
        self.max_bytes = max_bytes
        self.entries: dict[int, str] = {}
        self.sizes: dict[int, int] = {}  # seq -> bytes on disk
        self.droppable: dict[int, None] = {}  # droppable seqs, oldest first
        self.bytes = 0
        self.garbage = 0  # bytes of acked frames still in the file
        self.dropped = 0  # droppable frames evicted or refused for lack of room
        acked: set[int] = set()
        for line in (read_text(self.acked_path) or "").split():
            with contextlib.suppress(ValueError):
                acked.add(int(line))
        loaded: list[tuple[int, str, bool]] = []
        for line in (read_text(path) or "").splitlines():
            try:
                msg = json.loads(line)
                seq = int(msg["seq"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a crash mid-append
            if seq not in acked:
                loaded.append((seq, line, msg.get("type") in DROPPABLE_TYPES))
        for seq, line, droppable in sorted(loaded):
            self._add(seq, line, droppable=droppable)
        # Rewrite now so a torn line never sits in front of new appends.
        self._compact()

    @property
    def max_seq(self) -> int:
        return max(self.entries, default=0)

    def _add(self, seq: int, frame: str, *, droppable: bool) -> None:
        size = len(frame.encode()) + 1
        self.entries[seq] = frame
        self.sizes[seq] = size
        self.bytes += size
        if droppable:
            self.droppable[seq] = None

    def _pop(self, seq: int) -> str:
        frame = self.entries.pop(seq)
        self.bytes -= self.sizes.pop(seq)
        self.droppable.pop(seq, None)
        return frame

    def append(self, seq: int, frame: str, *, droppable: bool = False) -> bool:
        """Store ``frame`` durably; False if it is droppable and there is no room."""
        data = frame.encode() + b"\n"
        if self.max_bytes is not None and self.bytes + len(data) > self.max_bytes:
            self._make_room(len(data))
            if droppable and self.bytes + len(data) > self.max_bytes:
                self.dropped += 1
                return False
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._add(seq, frame, droppable=droppable)
        return True

    def _make_room(self, need: int) -> None:
        assert self.max_bytes is not None
        target = int(self.max_bytes * 0.9) - need
        evicted = 0
        while self.droppable and self.bytes > target:
            self._pop(next(iter(self.droppable)))
            evicted += 1
        if evicted:
            self.dropped += evicted
            log.warning(
                "spool over %d bytes: dropped the %d oldest metric samples"
                " and progress reports",
                self.max_bytes,
                evicted,
            )
            self._compact()

    def pending(self, after: int = 0) -> list[tuple[int, str]]:
        return [(s, f) for s, f in self.entries.items() if s > after]

    def remove(self, seqs: list[int]) -> list[dict[str, Any]]:
        """Drop acked frames; returns the non-droppable ones, parsed."""
        gone: list[dict[str, Any]] = []
        removed: list[int] = []
        for seq in seqs:
            if seq not in self.entries:
                continue
            droppable = seq in self.droppable
            size = self.sizes[seq]
            frame = self._pop(seq)
            self.garbage += size
            removed.append(seq)
            if not droppable:
                gone.append(json.loads(frame))
        if not removed:
            return gone
        if not self.entries or self.garbage >= max(self.bytes, COMPACT_MIN_BYTES):
            self._compact()
        else:
            with self.acked_path.open("a") as fh:
                fh.write("".join(f"{s}\n" for s in removed))
        return gone

    def _compact(self) -> None:
        atomic_write(self.path, "".join(f + "\n" for f in self.entries.values()))
        self.garbage = 0
        with contextlib.suppress(FileNotFoundError):
            self.acked_path.unlink()
