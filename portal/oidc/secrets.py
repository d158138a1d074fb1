"""The refresh tokens at rest: Fernet (AES-128-CBC with HMAC-SHA256, from
``cryptography``) under a key derived from ``GPULAB_OIDC_TOKEN_KEY`` (default: the
Django secret key and its fallbacks). Several keys: the first encrypts, each one
decrypts, so a key can be rotated without losing the stored tokens.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings

_CONTEXT = b"gpulab oidc refresh token v1"


class UnreadableToken(Exception):
    """A stored token none of the configured keys decrypts (the key changed)."""


def _fernet(passphrase: str) -> Fernet:
    # A keyed hash of the passphrase: 32 bytes whatever its length, and never the
    # secret key itself (which also signs sessions).
    digest = hashlib.blake2b(passphrase.encode(), key=_CONTEXT, digest_size=32).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def _keys() -> MultiFernet:
    keys = list(settings.GPULAB_OIDC_TOKEN_KEY) or [
        settings.SECRET_KEY,
        *getattr(settings, "SECRET_KEY_FALLBACKS", []),
    ]
    return MultiFernet([_fernet(k) for k in keys])


def encrypt(token: str) -> str:
    """``token`` encrypted; "" stays "" (nothing to keep)."""
    if not token:
        return ""
    return _keys().encrypt(token.encode()).decode("ascii")


def decrypt(stored: str) -> str:
    """The token ``encrypt`` stored; ``UnreadableToken`` when no key opens it."""
    if not stored:
        return ""
    try:
        return _keys().decrypt(stored.encode("ascii")).decode()
    except (InvalidToken, UnicodeError) as exc:
        raise UnreadableToken(
            "the stored refresh token cannot be decrypted with GPULAB_OIDC_TOKEN_KEY"
            " (changed without keeping the old key second?)"
        ) from exc
