"""The token bucket: a rate with a saved-up burst, the one allowance rule of the
websockets.

An agent connection has two (frames and bytes per second,
``scheduler.consumers``): its frames are handled one at a time, and when a node
sends faster than its allowance the consumer waits (``delay``) before handling
the next frame. Waiting (rather than dropping) loses nothing: the websocket stops
being read, TCP pushes back on the node, and a legitimate burst (a spool replayed
after a long outage) only takes longer. A node therefore never costs the portal
more than its rate, whatever it sends.

A browser tab has one (messages per second, ``portal.consumers``): a message past
it is refused (``take``), not delayed, and a refusal takes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass
class TokenBucket:
    """``rate`` tokens per second, at most ``rate * burst_s`` saved up."""

    rate: float
    burst_s: float
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    updated: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.capacity
        self.updated = self.clock()

    @property
    def capacity(self) -> float:
        return self.rate * self.burst_s

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if they are saved up (True); else take none (False)."""
        self._refill()
        if self.tokens < cost:
            return False
        self.tokens -= cost
        return True

    def delay(self, cost: float) -> float:
        """Take ``cost`` tokens; return how long to wait before going ahead (0 when
        the allowance covers it). A cost above the capacity waits for all of it."""
        self._refill()
        self.tokens -= cost
        if self.tokens >= 0:
            return 0.0
        return -self.tokens / self.rate
