"""Each scheduling pass's statistics, logged and kept for the admin console.

Like Slurm's ``sdiag``: the policy's ``PassStats`` (jobs considered, started,
preempted, reserved, backfilled, why the pass stopped, time per stage) plus the
runner's own load / decide / apply times make a ``PassRecord``. ``keep`` logs it
(INFO when the pass took longer than ``GPULAB_PASS_SLOW_S`` or stopped before the
end of the queue, DEBUG otherwise: a routine pass every few seconds is no event a
person needs) and stores it in Redis: the last ``GPULAB_PASS_LOG_SIZE`` records (a
capped list, newest first) and running totals since the totals began (a hash),
both read by the admin overview (``recent``, ``totals``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

import redis
from django.conf import settings

from scheduler.pass_requests import _redis_client

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scheduler.policy import PassStats

log = logging.getLogger(__name__)

# What a pass that looked at every waiting job reports (``PassStats.stop_reason``).
QUEUE_EXHAUSTED = "queue exhausted"
# The counters kept in the totals hash, beside "passes", the times and the stops.
COUNTS = ("considered", "started", "preempted", "reserved", "backfilled")
# Upper bounds (seconds) of the pass-duration histogram (``gpulab_pass_duration_
# seconds`` on /metrics): each pass adds one to the first bound it fits under
# ("+Inf" past the last), kept in the totals hash as ``le:<bound>``, so every web
# process exports the same monotone counts.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def duration_bucket(seconds: float) -> str:
    """The histogram bound a pass of ``seconds`` is counted under."""
    for bound in DURATION_BUCKETS:
        if seconds <= bound:
            return repr(bound)
    return "+Inf"


@dataclass(frozen=True)
class PassRecord:
    """One pass: when it ran (epoch seconds), what the policy did, and where the
    time went (seconds)."""

    at: float
    considered: int
    started: int
    preempted: int
    reserved: int
    backfilled: int
    stop_reason: str
    load_s: float  # reading the state (``services.snapshot``)
    decide_s: float  # ``policy.run_pass``
    apply_s: float  # ``services.apply_decisions`` and the quota alerts
    total_s: float
    stage_s: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        stats: PassStats,
        *,
        at: float,
        load_s: float,
        decide_s: float,
        apply_s: float,
        total_s: float,
    ) -> PassRecord:
        return cls(
            at=at,
            considered=stats.considered,
            started=stats.started,
            preempted=stats.preempted,
            reserved=stats.reserved,
            backfilled=stats.backfilled,
            stop_reason=stats.stop_reason,
            load_s=load_s,
            decide_s=decide_s,
            apply_s=apply_s,
            total_s=total_s,
            stage_s=dict(stats.stage_s),
        )

    @property
    def stopped_early(self) -> bool:
        return self.stop_reason != QUEUE_EXHAUSTED

    @property
    def notable(self) -> bool:
        """Worth an INFO line: slow, or stopped before the end of the queue."""
        return self.stopped_early or self.total_s > settings.GPULAB_PASS_SLOW_S

    def line(self) -> str:
        """The record as one log line."""
        stages = ", ".join(f"{k} {v * 1000:.1f}" for k, v in self.stage_s.items())
        return (
            f"scheduling pass: {self.total_s * 1000:.1f} ms (load"
            f" {self.load_s * 1000:.1f}, decide {self.decide_s * 1000:.1f}, apply"
            f" {self.apply_s * 1000:.1f}); considered {self.considered}, started"
            f" {self.started}, preempted {self.preempted}, reserved {self.reserved},"
            f" backfilled {self.backfilled}; stopped: {self.stop_reason}"
            + (f"; stages (ms): {stages}" if stages else "")
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> PassRecord | None:
        """The record ``to_json`` wrote; None for one this version cannot read
        (written by a version with other fields: Redis keeps records across an
        upgrade)."""
        data: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None


def _recent_key() -> str:
    return f"{settings.REDIS_PREFIX}:passes:recent"


def _totals_key() -> str:
    return f"{settings.REDIS_PREFIX}:passes:totals"


def keep(record: PassRecord) -> None:
    """Log ``record`` (INFO if ``notable``, else DEBUG) and store it: pushed on
    the recent list, which is cut to ``GPULAB_PASS_LOG_SIZE``, and added to the
    totals, in one transaction. Redis unavailable: logged and skipped (the pass
    itself has committed; its statistics are not worth failing it)."""
    log.log(logging.INFO if record.notable else logging.DEBUG, "%s", record.line())
    totals = _totals_key()
    try:
        client = _redis_client()
        # Passes run one at a time (the runner's advisory lock): the maximum is
        # read here and raised below without a race.
        slowest = cast("bytes | None", client.hget(totals, "max_s"))
        pipe = client.pipeline(transaction=True)
        pipe.lpush(_recent_key(), record.to_json())
        pipe.ltrim(_recent_key(), 0, settings.GPULAB_PASS_LOG_SIZE - 1)
        pipe.hsetnx(totals, "since", repr(record.at))
        pipe.hincrby(totals, "passes", 1)
        for name in COUNTS:
            pipe.hincrby(totals, name, getattr(record, name))
        pipe.hincrbyfloat(totals, "total_s", record.total_s)
        pipe.hincrby(totals, f"stop:{record.stop_reason}", 1)
        pipe.hincrby(totals, f"le:{duration_bucket(record.total_s)}", 1)
        if slowest is None or float(slowest) < record.total_s:
            pipe.hset(totals, "max_s", repr(record.total_s))
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("pass statistics not stored: %r", exc)


def recent(limit: int | None = None) -> list[PassRecord]:
    """The last passes' records, newest first (``limit`` at most; one that cannot
    be read is left out)."""
    end = -1 if limit is None else limit - 1
    raws = cast("list[bytes]", _redis_client().lrange(_recent_key(), 0, end))
    return [r for r in map(PassRecord.from_json, raws) if r is not None]


@dataclass(frozen=True)
class PassTotals:
    """Every pass recorded since ``since`` (epoch seconds; None: none yet)."""

    since: float | None
    passes: int
    counts: Mapping[str, int]  # ``COUNTS`` summed
    total_s: float
    max_s: float
    stops: Mapping[str, int]  # stop reason -> passes
    # ``duration_bucket`` -> passes in it (not cumulative; passes recorded before
    # the buckets were kept are in no bucket)
    durations: Mapping[str, int] = field(default_factory=dict)

    @property
    def mean_s(self) -> float | None:
        return self.total_s / self.passes if self.passes else None


def totals() -> PassTotals:
    stored = cast("dict[bytes, bytes]", _redis_client().hgetall(_totals_key()))
    raw = {k.decode(): v.decode() for k, v in stored.items()}
    return PassTotals(
        since=float(raw["since"]) if "since" in raw else None,
        passes=int(raw.get("passes", 0)),
        counts={name: int(raw.get(name, 0)) for name in COUNTS},
        total_s=float(raw.get("total_s", 0.0)),
        max_s=float(raw.get("max_s", 0.0)),
        stops={
            k.removeprefix("stop:"): int(v)
            for k, v in sorted(raw.items())
            if k.startswith("stop:")
        },
        durations={
            k.removeprefix("le:"): int(v) for k, v in raw.items() if k.startswith("le:")
        },
    )
