"""URL forms shared by the stack and settings (no Django import)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit


def celery_broker_url(redis_url: str) -> str:
    """The Celery broker URL for ``REDIS_URL``.

    redis-py and channels_redis take ``unix:///path/redis.sock?db=N``, but kombu has
    no ``unix`` transport ("No such transport: unix"): it spells a Unix socket
    ``redis+socket:///path/redis.sock?virtual_host=N``. Every other form
    (``redis://``, ``rediss://``) is returned unchanged.
    """
    parts = urlsplit(redis_url)
    if parts.scheme != "unix":
        return redis_url
    query = parse_qs(parts.query)
    db = query.get("db", ["0"])[0]
    auth = ""
    if parts.username or parts.password:
        auth = f"{parts.username or ''}:{parts.password or ''}@"
    return f"redis+socket://{auth}{parts.path}?virtual_host={db}"
