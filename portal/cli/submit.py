"""``gpulab submit``: the command line and options turned into the API's submit
fields (a job, or a job array with ``--array``)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from portal.cli import output
from portal.cli.app import State, cli, pass_state
from portal.units import (
    DURATION_HELP,
    MEMORY_HELP,
    parse_duration,
    parse_memory_mib,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    # generic in the stubs of click >= 8.2 only: subscripted for mypy alone
    _ParamType = click.ParamType[int | None, Any]
else:
    _ParamType = click.ParamType


# The API's names of the submit fields -> the options that set them.
SUBMIT_FIELDS = {
    "name": "--name",
    "command": "COMMAND",
    "workdir": "--workdir",
    "env": "--env",
    "gpus": "--gpus",
    "gpu_memory_mib": "--gpu-mem",
    "gpu_model": "--gpu-model",
    "time_limit_s": "--time",
    "priority_class": "--class",
    "shareable": "--share",
    "workload": "--workload",
    "group": "--group",
    "after": "--after",
    "array": "--array",
    "checkpointable": "--checkpointable",
    "checkpoint_signal": "--checkpoint-signal",
    "checkpoint_grace_s": "--checkpoint-grace",
}


class Parsed(_ParamType):
    """An option parsed by one of the request parsers (``parse_duration``,
    ``parse_memory_mib``); a value it refuses fails with the format's help."""

    def __init__(
        self, name: str, parse: Callable[[str], int | None], help_text: str
    ) -> None:
        self.name = name
        self.parse = parse
        self.help_text = help_text

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | None:
        try:
            return self.parse(str(value))
        except ValueError:
            self.fail(f"{value!r}: {self.help_text}", param, ctx)


def _env(values: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"{item!r}: write NAME=VALUE, e.g. --env OMP_NUM_THREADS=4",
                param_hint="'--env'",
            )
        env[key] = value
    return env


def command_text(words: Sequence[str]) -> str:
    """The words joined by spaces into the command line that ``/bin/sh -c``
    runs on the node, as ``ssh host WORDS...`` does: what the local shell
    left quoted (``'$GPULAB_ARRAY_INDEX'``, ``'a | b'``) the node's shell
    expands."""
    return " ".join(words)


def default_name(words: Sequence[str]) -> str:
    """``python train.py --lr 1`` -> ``train.py``: the script, else the program."""
    try:
        parts = shlex.split(command_text(words))
    except ValueError:
        parts = list(words)
    args = [p for p in parts[1:] if not p.startswith("-")]
    program = Path(parts[0]).name if parts else "job"
    interpreters = ("python", "python3", "bash", "sh", "torchrun", "accelerate")
    if program in interpreters and args:
        return Path(args[0]).name[:128] or program
    return program[:128] or "job"


@cli.command(
    context_settings={"allow_interspersed_args": False},
    epilog="\b\nExamples:\n"
    "  gpulab submit --gpus 2 --gpu-mem 40G --time 4h -- python train.py --lr 0.1\n"
    "  gpulab submit --array 0-99%8 -- python sweep.py --trial '$GPULAB_ARRAY_INDEX'\n"
    "  gpulab submit --after afterok:42 --name eval -- python eval.py\n"
    "  gpulab submit -- 'for i in 1 2 3; do python step.py $i; done'",
)
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs.")
@click.option(
    "--gpu-mem",
    type=Parsed("SIZE", parse_memory_mib, MEMORY_HELP),
    help="GPU memory the job needs on each GPU, e.g. 12G (required to share).",
)
@click.option("--gpu-model", default="", help="Only GPUs of this model, e.g. A100.")
@click.option(
    "--time",
    "time_limit",
    type=Parsed("DURATION", parse_duration, DURATION_HELP),
    help="Time limit, e.g. 4h, 90m, 1d12h (default: the class's).",
)
@click.option(
    "--class",
    "priority_class",
    default="",
    help="Priority class: high, normal (default), best-effort.",
)
@click.option(
    "--share/--exclusive",
    default=False,
    help="May share a GPU with another job (needs --gpu-mem); default exclusive.",
)
@click.option(
    "--array",
    "array_spec",
    metavar="SPEC",
    help="A job array: indexes and run-at-once limit, e.g. 0-99%8, 1,3,5-7, 0-10:2."
    " Each task gets GPULAB_ARRAY_INDEX.",
)
@click.option(
    "--after",
    multiple=True,
    metavar="DEP",
    help="Start after other jobs: 42 (afterany), afterok:42:43, afternotok:42,"
    " afterok:a7 (every task of array 7). Repeatable.",
)
@click.option("--name", help="The job's name (default: the script or program).")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where it runs (default: the current directory).",
)
@click.option(
    "--env",
    "env_items",
    multiple=True,
    metavar="NAME=VALUE",
    help="An environment variable for the job. Repeatable.",
)
@click.option(
    "--checkpointable",
    is_flag=True,
    help="The job saves checkpoints: preempted, it gets its checkpoint signal,"
    " the grace to save and exit, and is requeued (GPULAB_RESTART_COUNT).",
)
@click.option(
    "--checkpoint-signal",
    default="",
    metavar="SIG",
    help="The signal a preemption sends first: TERM (default), INT, USR1, USR2.",
)
@click.option(
    "--checkpoint-grace",
    type=Parsed("DURATION", parse_duration, DURATION_HELP),
    help="Time from the checkpoint signal to SIGKILL, e.g. 2m (default 60s).",
)
@click.option("--group", default="", help="The lab group to charge.")
@click.option("--workload", default="", help="A label for similar jobs.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@click.option(
    "-q",
    "--quiet",
    "--parsable",
    is_flag=True,
    help="Print only the id: 42, or a7 for an array (for --after, cancel).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_state
def submit(
    state: State,
    *,
    gpus: int,
    gpu_mem: int | None,
    gpu_model: str,
    time_limit: int | None,
    priority_class: str,
    share: bool,
    array_spec: str | None,
    after: tuple[str, ...],
    name: str | None,
    workdir: Path | None,
    env_items: tuple[str, ...],
    checkpointable: bool,
    checkpoint_signal: str,
    checkpoint_grace: int | None,
    group: str,
    workload: str,
    as_json: bool,
    quiet: bool,
    command: tuple[str, ...],
) -> None:
    """Submit COMMAND as a job (or a job array), like sbatch.

    Put the command after --: its own options then stay its own. It runs
    under /bin/sh on the node, its words joined by spaces as ssh does: quote
    what the node's shell should expand ('$GPULAB_ARRAY_INDEX', pipes, loops).
    """
    body: dict[str, Any] = {
        "name": name if name is not None else default_name(command),
        "command": command_text(command),
        "workdir": str((workdir or Path.cwd()).absolute()),
        "env": _env(env_items),
        "gpus": gpus,
        "gpu_memory_mib": gpu_mem,
        "gpu_model": gpu_model,
        "time_limit_s": time_limit,
        "priority_class": priority_class,
        "shareable": share,
        "workload": workload,
        "group": group,
        "after": ",".join(a.strip() for a in after),
    }
    if checkpointable or checkpoint_signal or checkpoint_grace is not None:
        # Only when asked: the server names what is wrong (a signal without
        # --checkpointable) and an older server is not sent fields it lacks.
        body["checkpointable"] = checkpointable
        body["checkpoint_signal"] = checkpoint_signal
        body["checkpoint_grace_s"] = checkpoint_grace
    api = state.api()
    if array_spec is not None:
        body["array"] = array_spec
        array = api.post("arrays/", body, fields=SUBMIT_FIELDS)
        if as_json:
            click.echo(output.dumps(array))
        elif quiet:
            click.echo(f"a{array['id']}")
        else:
            ids = [t["id"] for t in array["tasks"]]
            limit = array.get("max_running")
            click.echo(
                f"Submitted array a{array['id']}: {array['size']} tasks"
                f" (jobs {ids[0]}-{ids[-1]})"
                + (f", at most {limit} at once" if limit else "")
            )
        return
    job = api.post("jobs/", body, fields=SUBMIT_FIELDS)
    if as_json:
        click.echo(output.dumps(job))
    elif quiet:
        click.echo(str(job["id"]))
    else:
        click.echo(f"Submitted job {job['id']} ({job['state']})")
