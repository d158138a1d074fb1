"""Rate limiting per token, Redis-backed (GCRA, one atomic Lua script).

Each identity (the token, else the signed-in user, else the client address)
may make ``GPULAB_API_RATE_LIMIT`` requests per ``GPULAB_API_RATE_WINDOW``
seconds: a burst of the whole limit, then one request every window/limit
seconds. Over it the request gets 429 with ``Retry-After``. The clock is
Redis's (``TIME``), so every web process counts against the same state.
If Redis cannot be reached the request goes through (logged): the API is not
taken down with the broker, which the scheduler needs anyway.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import redis
from django.conf import settings
from rest_framework.throttling import BaseThrottle

from portal.api.models import ApiToken

if TYPE_CHECKING:
    from rest_framework.request import Request
    from rest_framework.views import APIView

log = logging.getLogger(__name__)

# KEYS[1]: the identity's key. ARGV: emission interval T and tolerance tau, in
# microseconds. Returns {allowed (0/1), microseconds to wait}.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tau = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local new_tat = tat + interval
local allow_at = new_tat - tau
if allow_at > now then
  return {0, allow_at - now}
end
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX',
           math.ceil((new_tat - now) / 1000) + 1)
return {1, 0}
"""

_client: redis.Redis | None = None
_script: Any = None


def _limiter() -> Any:
    global _client, _script
    if _script is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2.0)
        _script = _client.register_script(_GCRA)
    return _script


def identity(request: Request) -> str:
    """Whose budget a request spends: its token's, its user's, or its address's."""
    if isinstance(request.auth, ApiToken):
        return f"token:{request.auth.pk}"
    user = request.user
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return f"addr:{request.META.get('REMOTE_ADDR', '')}"


def hit(ident: str, limit: int, window: float) -> float:
    """Spend one request of ``ident``'s budget; 0 if allowed, else the seconds
    to wait."""
    interval = int(window * 1_000_000 / limit)
    tau = int(window * 1_000_000)
    key = f"{settings.REDIS_PREFIX}:api:rate:{ident}"
    allowed, wait_us = _limiter()(keys=[key], args=[interval, tau])
    return 0.0 if int(allowed) else int(wait_us) / 1_000_000


class RedisRateThrottle(BaseThrottle):
    """DRF throttle over ``hit``: the caller's budget is ``budget(request)``
    (a key, a limit and a window, or None for a request it does not count).
    With Redis down the request is let through and the failure logged."""

    # what the log says when Redis is down
    what = "API rate limit"

    def __init__(self) -> None:
        self.wait_s: float | None = None

    def budget(self, request: Request) -> tuple[str, int, float] | None:
        return (
            identity(request),
            settings.GPULAB_API_RATE_LIMIT,
            settings.GPULAB_API_RATE_WINDOW,
        )

    def allow_request(self, request: Request, view: APIView) -> bool:
        budget = self.budget(request)
        if budget is None:
            return True
        try:
            wait = hit(*budget)
        except redis.RedisError as exc:
            log.warning("%s not checked (Redis: %s)", self.what, exc)
            return True
        if wait <= 0:
            return True
        self.wait_s = wait
        return False

    def wait(self) -> float | None:
        return None if self.wait_s is None else float(math.ceil(self.wait_s))
