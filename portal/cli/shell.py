"""``gpulab shell``: a terminal on a GPU node, like ``srun --pty bash``.

Submits an interactive terminal job (or, with ``--job``, uses a running
interactive job of yours), waits until it runs, and attaches this terminal to a
shell there (``portal.cli.terminal``: raw mode, window size, Ctrl-C to the
remote foreground group). The command exits with the remote shell's status. A
job it submitted is cancelled when the shell ends, freeing its GPUs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from portal.cli.app import State, cli, pass_state
from portal.cli.errors import CliError, Exit
from portal.cli.submit import Parsed
from portal.cli.terminal import attach
from portal.units import DURATION_HELP, MEMORY_HELP, parse_duration, parse_memory_mib

if TYPE_CHECKING:
    from portal.cli.client import Api

# The API's names of the fields -> the options that set them.
SHELL_FIELDS = {
    "gpus": "--gpus",
    "gpu_memory_mib": "--gpu-mem",
    "time_limit_s": "--time",
    "shareable": "--share",
    "workdir": "--workdir",
    "group": "--group",
}
# How often the job's state is read while it waits.
POLL_S = 0.5
ENDED = frozenset({"completed", "failed", "cancelled", "timeout"})


def _say(text: str) -> None:
    click.echo(f"gpulab: {text}", err=True)


def wait_running(api: Api, job_id: int, *, quiet: bool) -> dict[str, Any]:
    """Wait until job ``job_id`` runs; a job that ends first is an error."""
    shown = ""
    while True:
        job: dict[str, Any] = api.get(f"jobs/{job_id}/")
        state = job["state"]
        if state == "running":
            return job
        if state in ENDED:
            reason = job.get("end_reason") or ""
            raise CliError(
                Exit.SERVER,
                f"job {job_id} is {state}" + (f": {reason}" if reason else ""),
            )
        why = job.get("reason_message") or ""
        if f"{state} {why}" != shown and not quiet:
            _say(
                f"job {job_id} is {state}"
                + (f" ({why})" if why else "")
                + "; waiting for it to start (Ctrl-C: stop)"
            )
            shown = f"{state} {why}"
        time.sleep(POLL_S)


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
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs.")
@click.option(
    "--gpu-mem",
    type=Parsed("memory", parse_memory_mib, MEMORY_HELP),
    help="GPU memory per GPU, e.g. 12G (a shared GPU).",
)
@click.option(
    "--time",
    "time_limit",
    type=Parsed("duration", parse_duration, DURATION_HELP),
    help="Time limit (default: the interactive class's).",
)
@click.option("--share", is_flag=True, help="May share its GPU with other jobs.")
@click.option(
    "--workdir",
    help="Where the shell starts (default: the current directory).",
)
@click.option("--group", default="", help="The lab group to charge.")
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
    workdir: str | None,
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
        body: dict[str, Any] = {
            "interactive": "shell",
            "gpus": gpus,
            "workdir": workdir or str(Path.cwd()),
            "shareable": share,
        }
        if gpu_mem is not None:
            body["gpu_memory_mib"] = gpu_mem
        if time_limit is not None:
            body["time_limit_s"] = time_limit
        if group:
            body["group"] = group
        job_id = int(api.post("jobs/", body, fields=SHELL_FIELDS)["id"])
        if not quiet:
            _say(f"submitted interactive job {job_id}")
    code: int | None = None
    try:
        wait_running(api, job_id, quiet=quiet)
        token = api.token
        ended = attach(api.server, token, job_id, command=command)
        code = ended.code
        if code is None:
            _say(ended.message or "the terminal ended")
    except KeyboardInterrupt:
        code = int(Exit.INTERRUPTED)
    finally:
        if submitted:
            try:
                api.post(f"jobs/{job_id}/cancel/")
                if not quiet:
                    _say(f"job {job_id} cancelled: its GPUs are free")
            except CliError as exc:
                _say(f"job {job_id} not cancelled: {exc.format_message()}")
    sys.stdout.flush()
    raise click.exceptions.Exit(1 if code is None else code)
