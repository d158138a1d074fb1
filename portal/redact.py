"""Keep secrets out of the logs.

uvicorn at ``--log-level debug`` has the websockets library log every handshake
header, among them an agent's ``Authorization: Bearer <node token>`` and a
browser's ``Cookie: sessionid=...``. ``RedactSecrets`` (in ``settings.LOGGING``, on
the console handler and on ``uvicorn.error``, whose records do not reach it) blanks
the values of such headers and of ``Bearer`` credentials in any record.
"""

from __future__ import annotations

import logging
import re

REDACTED = "[redacted]"
# "< authorization: Bearer x", "> Cookie: a=b", "Set-Cookie: ...": the whole value.
_HEADER = re.compile(
    r"(?im)^([<>]?\s*(?:proxy-)?authorization|[<>]?\s*(?:set-)?cookie"
    r"|[<>]?\s*x-gpulab-signature)(\s*:\s*)(\S.*)$"
)
# A credential written anywhere else: "Bearer <token>", "Token <token>" (16
# characters or more: a word after "token" in a sentence is left alone).
_CREDENTIAL = re.compile(r"(?i)\b(bearer|token)(\s+)([A-Za-z0-9._~+/=-]{16,})")


def redact(text: str) -> str:
    """``text`` with header values and bearer credentials replaced."""
    text = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    return _CREDENTIAL.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


class RedactSecrets(logging.Filter):
    """A logging filter that rewrites a record whose message holds a secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg = cleaned
            record.args = None
        return True
