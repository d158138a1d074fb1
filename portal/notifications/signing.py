"""The webhook signature: HMAC-SHA256 over ``"<timestamp>.<body>"``.

The receiver recomputes it with the shared secret from the ``X-Gpulab-Timestamp``
header and the raw request body, compares with ``hmac.compare_digest`` and refuses a
timestamp too far from its clock (a replay). ``verify`` is what a receiver written in
Python can copy.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "X-Gpulab-Signature"
TIMESTAMP_HEADER = "X-Gpulab-Timestamp"
PREFIX = "sha256="


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return PREFIX + mac.hexdigest()


def verify(
    secret: str,
    timestamp_header: str,
    signature_header: str,
    body: bytes,
    *,
    tolerance_s: int = 300,
    now: float | None = None,
) -> bool:
    """Whether a request carries a valid, fresh signature."""
    try:
        timestamp = int(timestamp_header)
    except ValueError:
        return False
    if abs((now if now is not None else time.time()) - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature_header)
