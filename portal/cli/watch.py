"""``gpulab logs`` and ``top``: a job's output (followed to its end with
``-f``) and the cluster live."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING

import click

from portal.cli import output
from portal.cli.app import State, cli, pass_state
from portal.cli.errors import Exit

if TYPE_CHECKING:
    from collections.abc import Iterator

    from portal.cli.client import Api


# How often ``logs -f`` asks for new output.
FOLLOW_EVERY_S = 1.0


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C ends a long-running command quietly with 130 (as a shell would)."""
    try:
        yield
    except KeyboardInterrupt:
        raise click.exceptions.Exit(Exit.INTERRUPTED) from None


def _write(data: str) -> None:
    if data:
        click.echo(data, nl=False)
        sys.stdout.flush()


@cli.command()
@click.argument("job_id", metavar="ID", type=int)
@click.option(
    "-f", "--follow", is_flag=True, help="Keep printing new output until the job ends."
)
@click.option(
    "--tail",
    type=click.IntRange(min=1),
    metavar="N",
    help="Only the last N lines (of the last 4 MiB).",
)
@click.option(
    "--attempt",
    type=click.IntRange(min=1),
    help="This attempt (default: the latest; a requeued job has several).",
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="This node of a multi-node job (0: the first).",
)
@pass_state
def logs(
    state: State,
    *,
    job_id: int,
    follow: bool,
    tail: int | None,
    attempt: int | None,
    rank: int,
) -> None:
    """A job's output (stdout and stderr as the job wrote them).

    With -f, new output is printed as it arrives, by byte offset, until the
    job ends; if the job is requeued, the new attempt's output follows.
    """
    api = state.api()
    with _interruptible():
        _logs(api, job_id, follow=follow, tail=tail, attempt=attempt, rank=rank)


def _logs(
    api: Api,
    job_id: int,
    *,
    follow: bool,
    tail: int | None,
    attempt: int | None,
    rank: int,
) -> None:
    offset = 0
    current: int | None = None
    if tail is not None:
        got = api.get(
            f"jobs/{job_id}/logs/",
            tail=min(4 * 1024 * 1024, max(64 * 1024, tail * 1024)),
            attempt=attempt,
            rank=rank,
        )
        lines = got["data"].splitlines(keepends=True)
        _write("".join(lines[-tail:]))
        offset, current = got["next_offset"], got["attempt"]
        if not follow:
            return
    while True:
        got = api.get(f"jobs/{job_id}/logs/", offset=offset, attempt=attempt, rank=rank)
        if attempt is None and current is not None and got["attempt"] != current:
            # requeued: the new attempt's output starts at 0
            click.echo(
                f"gpulab: job {job_id} was requeued; attempt {got['attempt']}:",
                err=True,
            )
            offset, current = 0, got["attempt"]
            continue
        current = got["attempt"]
        _write(got["data"])
        moved = got["next_offset"] != offset
        offset = got["next_offset"]
        if moved and got["data"]:
            continue  # there may be more right now
        if not follow:
            if got["attempt"] is None:
                job = api.get(f"jobs/{job_id}/")
                click.echo(
                    f"gpulab: job {job_id} has not run ({job['state']})", err=True
                )
            return
        if got["complete"]:
            if attempt is not None:
                return
            job = api.get(f"jobs/{job_id}/")
            if job["state"] in output.TERMINAL and job["attempts"] <= (current or 0):
                return
        time.sleep(FOLLOW_EVERY_S)


# ------------------------------------------------------------------ top


@cli.command()
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.5),
    default=2.0,
    show_default=True,
    help="Seconds between redraws.",
)
@pass_state
def top(state: State, *, once: bool, interval: float) -> None:
    """The cluster live, like nvitop: nodes, GPUs with utilisation and memory
    bars, temperature, power and the jobs that hold them. q or Ctrl-C quits.
    Into a pipe or a file it prints one frame, as --once does."""
    from rich.console import Console

    from portal.cli import top as view

    api = state.api()
    if once or not sys.stdout.isatty():
        # a pipe or a file gets one frame at a readable width
        columns = os.environ.get("COLUMNS", "")
        width = (
            int(columns)
            if columns.isascii() and columns.isdigit() and len(columns) < 5
            else 120
        )
        view.print_once(api, Console(width=width, highlight=False))
        return
    with _interruptible():
        view.live(api, Console(highlight=False), interval)
