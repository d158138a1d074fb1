"""Exit codes that scripts can rely on, and the one error the commands raise.

| code | meaning |
| --- | --- |
| 0 | done |
| 1 | the server refused or failed the request: not allowed (403), the job's state
      forbids it (409), rate limited (429), a server error (5xx), an answer that
      is not the gpulab API's |
| 2 | usage: bad arguments, or input the API refused as invalid (400, the field
      named) or too large (413) |
| 3 | authentication: not logged in, or a bad, expired or revoked token (401) |
| 4 | not found: no such job, array or node visible to you (404) |
| 5 | network: the server could not be reached (refused, DNS, TLS, timeout) |
| 130 | interrupted (Ctrl-C) |
"""

from __future__ import annotations

from enum import IntEnum
from typing import IO, Any

import click


class Exit(IntEnum):
    OK = 0
    SERVER = 1
    USAGE = 2
    AUTH = 3
    NOT_FOUND = 4
    NETWORK = 5
    INTERRUPTED = 130


class CliError(click.ClickException):
    """A failure with its exit code and a message that says what to do; click
    prints it on stderr as ``gpulab: <message>`` and exits with the code."""

    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        # click declares exit_code per class; here one class serves every code
        self.exit_code = int(code)  # type: ignore[misc]

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"gpulab: {self.format_message()}", err=True, file=file)
