"""``gpulab``: submit, watch and cancel jobs from a shell.

Every command is a thin adapter over ``/api/v1/``: it parses its arguments
into the API's fields (``portal.units`` for "4h" and "12G", the submit form's
parser), makes the request and prints the answer. Every rule about a job is
the server's, and comes back as an error naming the option at fault. Exit
codes: ``portal.cli.errors``.

The group and what the commands share are in ``portal.cli.app``; the commands
in ``account`` (login, logout, whoami, usage), ``submit``, ``interactive``
(jupyter), ``jobs`` (ls, queue, show, cancel), ``watch`` (logs, top) and
``shell`` (a terminal in an interactive job). Importing them here registers
them on ``cli``.
"""

from __future__ import annotations

from portal.cli import account, interactive, jobs, shell, submit, watch
from portal.cli.app import cli

__all__ = ["account", "cli", "interactive", "jobs", "main", "shell", "submit", "watch"]


def main() -> None:
    """The ``gpulab`` console script."""
    cli(prog_name="gpulab")
