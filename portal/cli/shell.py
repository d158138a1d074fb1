"""``gpulab shell``: a terminal on a GPU node, like ``srun --pty bash``.

Submits an interactive terminal job (or, with ``--job``, uses a running
interactive job of yours), waits until it runs, and attaches this terminal to a
shell there (``portal.cli.terminal``: raw mode, window size, Ctrl-C to the
remote foreground group). The command exits with the remote shell's status. A
job it submitted is cancelled when the shell ends, freeing its GPUs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from portal.cli.app import State, cli, pass_state
from portal.cli.errors import CliError, Exit
from portal.cli.interactive import (
    JOB_FIELDS,
    job_options,
    request_body,
    say,
    wait_running,
)
from portal.cli.terminal import attach

if TYPE_CHECKING:
    from pathlib import Path

# The API's names of the fields -> the options that set them.
SHELL_FIELDS = {"interactive": "gpulab shell", **JOB_FIELDS}


@cli.command()
@click.option(
    "--job",
    "job_id",
    type=click.IntRange(min=1),
    metavar="ID",
    help="Open a terminal in this running interactive job of yours instead of"
    " submitting one.",
)
@click.option(
    "-c",
    "command",
    metavar="COMMAND",
    help="Run COMMAND in the shell and exit with its status.",
)
@job_options("Where the shell starts")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
@pass_state
def shell(
    state: State,
    *,
    job_id: int | None,
    command: str | None,
    gpus: int,
    gpu_mem: int | None,
    time_limit: int | None,
    share: bool,
    workdir: Path | None,
    group: str,
    quiet: bool,
) -> None:
    """A shell on a GPU node, as an interactive job (like srun --pty bash).

    \b
    gpulab shell                      a terminal with one GPU until you exit
    gpulab shell -c nvidia-smi        run one command there, exit with its status
    gpulab shell --job 42             another terminal in interactive job 42
    """
    api = state.api()
    submitted = job_id is None
    if job_id is None:
        body = request_body(
            "shell", gpus=gpus, gpu_mem=gpu_mem, time_limit=time_limit,
            share=share, workdir=workdir, group=group,
        )  # fmt: skip
        job_id = int(api.post("jobs/", body, fields=SHELL_FIELDS)["id"])
        if not quiet:
            say(f"submitted interactive job {job_id}")
    code: int | None = None
    try:
        wait_running(api, job_id, quiet=quiet)
        token = api.token
        ended = attach(api.server, token, job_id, command=command)
        code = ended.code
        if code is None:
            say(ended.message or "the terminal ended")
    except KeyboardInterrupt:
        code = int(Exit.INTERRUPTED)
    finally:
        if submitted:
            try:
                api.post(f"jobs/{job_id}/cancel/")
                if not quiet:
                    say(f"job {job_id} cancelled: its GPUs are free")
            except CliError as exc:
                say(f"job {job_id} not cancelled: {exc.format_message()}")
    sys.stdout.flush()
    raise click.exceptions.Exit(1 if code is None else code)
