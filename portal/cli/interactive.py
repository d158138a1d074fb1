"""``gpulab jupyter``: start JupyterLab on a GPU node as an interactive job and
print where the portal serves it (``/interactive/<id>/lab``, opened in the
browser signed in to the portal; never the server's token)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from agents.jobtext import for_terminal
from portal.cli.app import State, cli, pass_state
from portal.cli.errors import CliError, Exit
from portal.cli.submit import Parsed
from portal.units import DURATION_HELP, MEMORY_HELP, parse_duration, parse_memory_mib

if TYPE_CHECKING:
    from portal.cli.client import Api

# The API's names of the fields -> the options that set them.
JOB_FIELDS = {
    "gpus": "--gpus",
    "gpu_memory_mib": "--gpu-mem",
    "time_limit_s": "--time",
    "shareable": "--share",
    "workdir": "--workdir",
    "group": "--group",
}
JUPYTER_FIELDS = {"interactive": "gpulab jupyter", **JOB_FIELDS}
# How often the job's state is read while it waits (one small GET).
POLL_S = 0.5
ENDED = frozenset({"completed", "failed", "cancelled", "timeout"})

F = TypeVar("F", bound=Callable[..., Any])


def job_options(where: str) -> Callable[[F], F]:
    """The options of an interactive job's request that ``gpulab jupyter`` and
    ``gpulab shell`` share; ``where`` says what starts in ``--workdir``."""
    options = [
        click.option("--gpus", type=int, default=1, show_default=True, help="GPUs."),
        click.option(
            "--gpu-mem",
            type=Parsed("SIZE", parse_memory_mib, MEMORY_HELP),
            help="GPU memory it needs on each GPU, e.g. 12G (required to share).",
        ),
        click.option(
            "--time",
            "time_limit",
            type=Parsed("DURATION", parse_duration, DURATION_HELP),
            help="Time limit, e.g. 4h (default and maximum: the interactive class's).",
        ),
        click.option(
            "--share/--exclusive",
            default=False,
            help="May share a GPU with another job (needs --gpu-mem); default"
            " exclusive.",
        ),
        click.option(
            "--workdir",
            type=click.Path(file_okay=False, path_type=Path),
            help=f"{where} (default: the current directory).",
        ),
        click.option("--group", default="", help="The lab group to charge."),
    ]

    def apply(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def request_body(
    kind: str,
    *,
    gpus: int,
    gpu_mem: int | None,
    time_limit: int | None,
    share: bool,
    workdir: Path | None,
    group: str,
) -> dict[str, Any]:
    """The API's job request for an interactive job of ``kind`` from the
    options of ``job_options``."""
    return {
        "interactive": kind,
        "gpus": gpus,
        "gpu_memory_mib": gpu_mem,
        "time_limit_s": time_limit,
        "shareable": share,
        "workdir": str((workdir or Path.cwd()).absolute()),
        "group": group,
    }


def say(text: str) -> None:
    click.echo(f"gpulab: {text}", err=True)


def wait_running(api: Api, job_id: int, *, quiet: bool) -> dict[str, Any]:
    """Wait until job ``job_id`` runs, saying why it waits whenever that
    changes (unless ``quiet``); a job that ends first is an error."""
    shown = ""
    while True:
        job: dict[str, Any] = api.get(f"jobs/{job_id}/")
        state = job["state"]
        if state == "running":
            return job
        if state in ENDED:
            reason = for_terminal(job.get("end_reason") or "")
            raise CliError(
                Exit.SERVER,
                f"job {job_id} did not start: it is {state}"
                + (f": {reason}" if reason else ""),
            )
        why = job.get("reason_message") or ""
        if f"{state} {why}" != shown and not quiet:
            say(
                f"job {job_id} is {state}"
                + (f" ({why})" if why else "")
                + "; waiting for it to start (Ctrl-C: stop)"
            )
            shown = f"{state} {why}"
        time.sleep(POLL_S)


@cli.command(
    epilog="\b\nExamples:\n"
    "  gpulab jupyter\n"
    "  gpulab jupyter --gpus 2 --time 4h --workdir ~/project\n"
    "  gpulab jupyter --gpu-mem 20G --share --no-wait",
)
@job_options("JupyterLab's directory")
@click.option(
    "--wait/--no-wait",
    default=True,
    help="Wait until it runs, then print its address (default), or print the"
    " job's id at once.",
)
@pass_state
def jupyter(
    state: State,
    *,
    gpus: int,
    gpu_mem: int | None,
    time_limit: int | None,
    share: bool,
    workdir: Path | None,
    group: str,
    wait: bool,
) -> None:
    """Start JupyterLab on a GPU node (an interactive job) and print its address.

    It runs as your Unix account in the working directory with the job's
    GPUs, is queued and charged like any job, and ends at its time limit or
    when cancelled (gpulab cancel ID). Open the address in the browser where
    you are signed in to the portal.
    """
    body = request_body(
        "jupyter", gpus=gpus, gpu_mem=gpu_mem, time_limit=time_limit, share=share,
        workdir=workdir, group=group,
    )  # fmt: skip
    api = state.api()
    job = api.post("jobs/", body, fields=JUPYTER_FIELDS)
    job_id = job["id"]
    url = f"{api.server}{job['interactive_url']}lab"
    if not wait:
        click.echo(f"Submitted JupyterLab as job {job_id}; it opens at {url}")
        return
    click.echo(f"Submitted JupyterLab as job {job_id}; waiting for it to start...")
    wait_running(api, job_id, quiet=False)
    click.echo(f"JupyterLab runs (job {job_id}); open {url}")
