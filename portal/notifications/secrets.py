"""Webhook secrets at rest: encrypted with Fernet (AES-128-CBC and HMAC-SHA256,
from ``cryptography``), the key derived (SHA-256) from ``GPULAB_WEBHOOK_SECRET_KEY``
(default: from ``DJANGO_SECRET_KEY``). Several keys: the first encrypts, each
decrypts, so a key can be rotated without losing the stored secrets.

Stored as ``fernet:<token>``. A secret no configured key can read any more (the
key changed without the old one kept) is ``Unreadable``: nothing crashes and
nothing is sent unsigned; its owner is asked to set it again. Secrets are never
logged.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings

PREFIX = "fernet:"


class Unreadable(Exception):
    """A stored secret that no configured key decrypts."""


def _fernet() -> MultiFernet:
    return MultiFernet(
        [
            Fernet(base64.urlsafe_b64encode(hashlib.sha256(key.encode()).digest()))
            for key in settings.GPULAB_WEBHOOK_SECRET_KEY
        ]
    )


def encrypt(plain: str) -> str:
    """What to store for ``plain`` ("" stays "": no secret)."""
    if not plain:
        return ""
    return PREFIX + _fernet().encrypt(plain.encode()).decode()


def decrypt(stored: str) -> str:
    """The secret stored as ``stored`` ("" for none); raises ``Unreadable``."""
    if not stored:
        return ""
    if not stored.startswith(PREFIX):
        raise Unreadable("not an encrypted secret")
    try:
        return _fernet().decrypt(stored[len(PREFIX) :].encode()).decode()
    except (InvalidToken, ValueError):
        raise Unreadable("no configured key decrypts it") from None
