"""Decayed usage for the simulator's fair share: GPU-seconds with a half-life,
kept as rates so that a pass reads them in O(groups + users)."""

from __future__ import annotations

import math


class DecayedUsage:
    """Half-life-decayed GPU-seconds per key, accrued from a rate (GPUs in use),
    in O(1) per rate change: values are kept scaled by 2^((t - t0)/H)."""

    def __init__(self, half_life_s: float, t0: float = 0.0) -> None:
        self.h = half_life_s
        self.k = half_life_s / math.log(2)
        self.t0 = t0
        self.scaled: dict[object, float] = {}
        self.rate: dict[object, float] = {}
        self.last: dict[object, float] = {}

    def _e(self, t: float) -> float:
        return float(2.0 ** ((t - self.t0) / self.h))

    def _fold(self, key: object, t: float) -> None:
        rate = self.rate.get(key, 0.0)
        if rate:
            last = self.last[key]
            self.scaled[key] = self.scaled.get(key, 0.0) + rate * self.k * (
                self._e(t) - self._e(last)
            )
        self.last[key] = t

    def add_rate(self, key: object, t: float, delta: float) -> None:
        if (t - self.t0) / self.h > 500:
            self._renormalise(t)
        self._fold(key, t)
        self.rate[key] = self.rate.get(key, 0.0) + delta
        self.scaled.setdefault(key, 0.0)

    def _renormalise(self, t: float) -> None:
        values = self.values(t)
        self.t0 = t
        self.scaled = dict(values)
        self.last = dict.fromkeys(values, t)

    def values(self, t: float) -> dict[object, float]:
        e_now = self._e(t)
        out = {}
        for key, s in self.scaled.items():
            rate = self.rate.get(key, 0.0)
            if rate:
                s += rate * self.k * (e_now - self._e(self.last[key]))
            out[key] = s / e_now
        return out
