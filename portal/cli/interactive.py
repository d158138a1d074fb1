"""``gpulab jupyter``: start JupyterLab on a GPU node as an interactive job and
print where the portal serves it (``/interactive/<id>/lab``, opened in the
browser signed in to the portal; never the server's token)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from agents.jobtext import for_terminal
from portal.cli.app import State, cli, pass_state
from portal.cli.errors import CliError, Exit
from portal.cli.submit import Parsed
from portal.units import DURATION_HELP, MEMORY_HELP, parse_duration, parse_memory_mib

# The API's names of the fields -> the options that set them.
JUPYTER_FIELDS = {
    "interactive": "gpulab jupyter",
    "gpus": "--gpus",
    "gpu_memory_mib": "--gpu-mem",
    "time_limit_s": "--time",
    "shareable": "--share",
    "workdir": "--workdir",
    "group": "--group",
}
WAITING = ("pending", "held", "starting")
# How often the job is asked about while it waits (one small GET).
POLL_S = 1.0


@cli.command(
    epilog="\b\nExamples:\n"
    "  gpulab jupyter\n"
    "  gpulab jupyter --gpus 2 --time 4h --workdir ~/project\n"
    "  gpulab jupyter --gpu-mem 20G --share --no-wait",
)
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs.")
@click.option(
    "--gpu-mem",
    type=Parsed("SIZE", parse_memory_mib, MEMORY_HELP),
    help="GPU memory it needs on each GPU, e.g. 12G (required to share).",
)
@click.option(
    "--time",
    "time_limit",
    type=Parsed("DURATION", parse_duration, DURATION_HELP),
    help="Time limit, e.g. 4h (default and maximum: the interactive class's).",
)
@click.option(
    "--share/--exclusive",
    default=False,
    help="May share a GPU with another job (needs --gpu-mem); default exclusive.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="JupyterLab's directory (default: the current directory).",
)
@click.option("--group", default="", help="The lab group to charge.")
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
    body: dict[str, Any] = {
        "interactive": "jupyter",
        "gpus": gpus,
        "gpu_memory_mib": gpu_mem,
        "time_limit_s": time_limit,
        "shareable": share,
        "workdir": str((workdir or Path.cwd()).absolute()),
        "group": group,
    }
    api = state.api()
    job = api.post("jobs/", body, fields=JUPYTER_FIELDS)
    job_id = job["id"]
    url = f"{api.server}{job['interactive_url']}lab"
    if not wait:
        click.echo(f"Submitted JupyterLab as job {job_id}; it opens at {url}")
        return
    click.echo(f"Submitted JupyterLab as job {job_id}; waiting for it to start...")
    while job["state"] in WAITING:
        time.sleep(POLL_S)
        job = api.get(f"jobs/{job_id}/")
    if job["state"] != "running":
        reason = for_terminal(job.get("end_reason") or job["state"])
        raise CliError(Exit.SERVER, f"job {job_id} did not start: {reason}")
    click.echo(f"JupyterLab runs (job {job_id}); open {url}")
