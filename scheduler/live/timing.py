"""The live paths' clock and limits: the update interval (``GPULAB_LIVE_INTERVAL``),
how long a watch, a claim, a node's readings and a live frame last, and how often
members rejoin their groups."""

from __future__ import annotations

import time

from django.conf import settings

# A subscription stays in the watch set this long without a refresh (a web process
# that died leaves its groups watched at most this long).
WATCH_TTL_S = 60.0
WATCH_REFRESH_S = 20.0
# The agent consumer's cache of which attempts hold its node's GPUs is reloaded
# when a launch, kill, start or exit passes through it, and at least this often.
HOLDERS_MAX_AGE_S = 30.0
# A metrics frame older than this (replayed from the agent's spool after a
# reconnect) is stored but not shown as live.
LIVE_MAX_AGE_S = 10.0
# Whoever claims a round has this long to publish it before another may.
CLAIM_MS = 2000
# The nodes' last readings kept for the aggregator vanish when no node sent any
# for this long (then the database's latest state is all there is).
READINGS_TTL_S = 60
# The hub's members (browser consumers) join their groups again this often: a
# membership is gone when Redis restarted, and lapses after channels_redis's
# group expiry (a day) on a tab left open.
REJOIN_S = 10.0


def interval() -> float:
    return float(settings.GPULAB_LIVE_INTERVAL)


def monotonic() -> float:
    return time.monotonic()
