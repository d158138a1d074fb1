"""``portal.redact``: header values and bearer credentials blanked in log records,
everything else left as it was."""

from __future__ import annotations

import logging

import pytest

from portal.redact import REDACTED, RedactSecrets, redact


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("< authorization: Bearer abc.def-123", f"< authorization: {REDACTED}"),
        ("> Cookie: sessionid=s3cr3t; csrftoken=x", f"> Cookie: {REDACTED}"),
        ("Set-Cookie: sessionid=s3cr3t; HttpOnly", f"Set-Cookie: {REDACTED}"),
        ("X-Gpulab-Signature: sha256=ab12", f"X-Gpulab-Signature: {REDACTED}"),
        ("sent with Bearer Zm9vYmFyYmF6cXV4Zm9v", f"sent with Bearer {REDACTED}"),
        ("rejected: Token abcdefgh12345678", f"rejected: Token {REDACTED}"),
        ("token rotation finished for node-07", None),
        ("< host: 127.0.0.1:8000", "< host: 127.0.0.1:8000"),
        ("server rejected the token (close code 4401)", None),
    ],
)
def test_it_blanks_secrets_and_keeps_the_rest(line: str, expected: str | None) -> None:
    assert redact(line) == (line if expected is None else expected)


def test_the_filter_rewrites_the_record_with_its_arguments() -> None:
    record = logging.LogRecord(
        "uvicorn.error", logging.DEBUG, __file__, 1, "< %s: %s",
        ("authorization", "Bearer tok-123456789"), None,
    )  # fmt: skip

    assert RedactSecrets().filter(record) is True
    assert record.getMessage() == f"< authorization: {REDACTED}"
