"""``gpulab``: submit, watch and cancel jobs from a shell (issue 8).

Every command is a thin adapter over ``/api/v1/``: it parses its arguments
into the API's fields (``portal.units`` for "4h" and "12G", the submit form's
parser), makes the request and prints the answer. Every rule about a job is
the server's, and comes back as an error naming the option at fault. Exit
codes: ``portal.cli.errors``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from portal.cli import config, output
from portal.cli.client import Api, cli_version
from portal.cli.errors import CliError, Exit
from portal.units import (
    DURATION_HELP,
    MEMORY_HELP,
    parse_duration,
    parse_memory_mib,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

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
}
FOLLOW_EVERY_S = 1.0
EXIT_CODES = """\b
Exit codes:
  0  done
  1  the server refused or failed it (not allowed, wrong state, rate limited,
     server error)
  2  usage: bad arguments, or input the server refused as invalid
  3  not logged in, or a bad, expired or revoked token
  4  no such job, array or node visible to you
  5  the server could not be reached
  130  interrupted (Ctrl-C)
"""


class State:
    """What every command shares: the ``--server`` given, and the client."""

    def __init__(self, server: str | None) -> None:
        self.server_option = server
        self._api: Api | None = None

    def api(self) -> Api:
        if self._api is None:
            target = config.resolve(self.server_option, os.environ)
            if not target.token:
                raise CliError(
                    Exit.AUTH,
                    f"not logged in to {target.server}: run 'gpulab login' (or set"
                    f" {config.TOKEN_ENV})",
                )
            self._api = Api(target.server, target.token)
        return self._api

    def close(self) -> None:
        if self._api is not None:
            self._api.close()


pass_state = click.make_pass_decorator(State)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=EXIT_CODES,
)
@click.option(
    "--server",
    metavar="URL",
    help=f"The portal, e.g. https://gpulab.lab.example (default: ${config.SERVER_ENV},"
    " else the one you last logged in to).",
)
@click.version_option(cli_version(), "-V", "--version", prog_name="gpulab")
@click.pass_context
def cli(ctx: click.Context, server: str | None) -> None:
    """gpulab: the lab's GPU pool from a shell.

    \b
    gpulab login                      store a token (from the Tokens page)
    gpulab submit --gpus 2 --time 4h -- python train.py --lr 0.1
    gpulab ls / gpulab queue          my jobs / the whole queue
    gpulab logs -f 42                 follow a job's output to its end
    gpulab top                        the cluster, live
    """
    state = State(server)
    ctx.obj = state
    ctx.call_on_close(state.close)


# ------------------------------------------------------------------ login


def _read_token() -> str:
    """Asked without echo on a terminal; else the first line of stdin (so that
    ``echo $TOKEN | gpulab login`` works and the token never is an argument,
    which ``ps`` would show)."""
    stdin = sys.stdin
    if stdin.isatty():
        token = click.prompt("Token (from the Tokens page)", hide_input=True)
    else:
        token = stdin.readline()
    return str(token).strip()


@cli.command()
@click.pass_context
def login(ctx: click.Context) -> None:
    """Store a personal token for a server.

    Create the token on the portal's Tokens page. The server comes from
    --server, $GPULAB_SERVER, or a prompt; the token from a prompt that does not
    echo it, or from stdin when it is not a terminal
    (echo "$TOKEN" | gpulab --server URL login). The token is checked with the
    server before it is stored, in your config directory, readable by you only
    (mode 600), for that server only.
    """
    state: State = ctx.obj
    stored = config.load()
    raw = state.server_option or os.environ.get(config.SERVER_ENV)
    if not raw and sys.stdin.isatty():
        raw = click.prompt(
            "Server", default=stored.server or config.DEFAULT_SERVER, err=True
        )
    if not raw:  # stdin carries the token: it cannot answer a prompt too
        raise CliError(
            Exit.USAGE,
            f"which server? give --server URL (or set {config.SERVER_ENV})",
        )
    server = config.normalise_server(str(raw))
    if not server.startswith("https://") and not config.is_loopback(server):
        click.echo(
            f"gpulab: warning: {server} is plain http: the token crosses the"
            " network unencrypted; use https:// if the portal has it",
            err=True,
        )
    token = _read_token()
    if not token:
        raise CliError(Exit.USAGE, "no token given; create one on the Tokens page")
    api = Api(server, token)
    try:
        me = api.get("me/")  # a bad token stops here: nothing is stored
    finally:
        api.close()
    stored.server = server
    stored.tokens[server] = token
    path = config.save(stored)
    expires = me.get("token_expires_at")
    click.echo(
        f"Logged in to {server} as {me['username']} (token {me.get('token')!r}, "
        + (f"expires {output.clock(expires)})" if expires else "no expiry)")
    )
    click.echo(f"Token stored in {path} (mode 600).")


@cli.command()
@pass_state
def logout(state: State) -> None:
    """Forget the stored token of the server (revoke it on the Tokens page)."""
    stored = config.load()
    raw = state.server_option or os.environ.get(config.SERVER_ENV) or stored.server
    if not raw:
        click.echo("Not logged in.")
        return
    server = config.normalise_server(raw)
    if stored.tokens.pop(server, None) is None:
        click.echo(f"Not logged in to {server}.")
        return
    config.save(stored)
    click.echo(
        f"Forgot the token of {server}; it works until it expires or you revoke"
        " it on the Tokens page."
    )


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@pass_state
def whoami(state: State, *, as_json: bool) -> None:
    """Who the token is: user, groups, the token's name and expiry."""
    api = state.api()
    me = api.get("me/")
    if as_json:
        click.echo(output.dumps(me))
        return
    groups = ", ".join(me["groups"]) or "none"
    click.echo(f"{me['username']} on {api.server} (groups: {groups})")
    if me.get("staff"):
        click.echo("staff: you see every job")
    if me.get("token"):
        expires = me.get("token_expires_at")
        click.echo(
            f"token {me['token']!r}, "
            + (f"expires {output.clock(expires)}" if expires else "no expiry")
        )


# ------------------------------------------------------------------ submit


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


# ------------------------------------------------------------------ ls, queue


def _pages(api: Api, limit: int, **params: Any) -> list[Any]:
    """Up to ``limit`` jobs, newest first, following the API's pages."""
    jobs: list[Any] = []
    while len(jobs) < limit:
        page = api.get(
            "jobs/", limit=min(1000, limit - len(jobs)), offset=len(jobs), **params
        )
        jobs += page["results"]
        if not page["next"] or not page["results"]:
            break
    return jobs


def _array_param(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip().lower().removeprefix("a")
    if not text.isdigit() or not 0 < int(text) < 2**62:
        raise click.BadParameter(
            f"{value!r} is not an array id (e.g. a7 or 7)", param_hint="'--array'"
        )
    return int(text)


@cli.command(name="ls")
@click.option(
    "-a", "--all", "show_all", is_flag=True, help="Also ended jobs (newest first)."
)
@click.option(
    "--state",
    "states",
    metavar="STATES",
    help="Only these states, comma-separated (pending, running, failed, ...;"
    " active = pending, held, starting, running).",
)
@click.option("--array", "array_id", metavar="ID", help="Only the tasks of an array.")
@click.option(
    "-n",
    "--limit",
    type=click.IntRange(1, 100_000),
    default=200,
    show_default=True,
    help="At most this many jobs (the newest).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@pass_state
def ls(
    state: State,
    *,
    show_all: bool,
    states: str | None,
    array_id: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """My jobs, like squeue --me: the waiting and running ones (-a: ended
    ones too), oldest first."""
    array = _array_param(array_id)
    api = state.api()
    me = api.get("me/")
    wanted = states if states is not None else (None if show_all else "active")
    jobs = _pages(api, limit, owner=me["username"], state=wanted, array=array)
    jobs.reverse()  # the API gives the newest first
    if as_json:
        click.echo(output.dumps(jobs))
    else:
        click.echo(output.jobs_table(jobs))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@pass_state
def queue(state: State, *, as_json: bool) -> None:
    """The whole queue, like squeue: every running job, then every waiting one
    in the order the scheduler will consider them."""
    jobs = state.api().get("queue/")
    if as_json:
        click.echo(output.dumps(jobs))
    else:
        click.echo(output.jobs_table(jobs))


# ------------------------------------------------------------------ show, cancel


def parse_id(text: str) -> tuple[str, int]:
    """``42`` -> ("job", 42); ``a7`` -> ("array", 7); a usage error else."""
    raw = text.strip().lower()
    kind = "array" if raw.startswith("a") else "job"
    digits = raw[1:] if kind == "array" else raw
    if not digits.isdigit() or not 0 < int(digits) < 2**62:
        raise click.BadParameter(
            f"{text!r} is not a job id (e.g. 42) or an array id (e.g. a7)",
            param_hint="'ID'",
        )
    return kind, int(digits)


@cli.command()
@click.argument("ident", metavar="ID")
@click.option("--events", is_flag=True, help="Also the job's history.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@pass_state
def show(state: State, *, ident: str, events: bool, as_json: bool) -> None:
    """One job (42) or job array (a7) in full, like scontrol show job."""
    kind, pk = parse_id(ident)
    api = state.api()
    if kind == "array":
        array = api.get(f"arrays/{pk}/")
        click.echo(output.dumps(array) if as_json else output.array_detail(array))
        return
    job = api.get(f"jobs/{pk}/")
    history = api.get(f"jobs/{pk}/events/") if events else None
    if as_json:
        click.echo(output.dumps({**job, "events": history} if events else job))
        return
    click.echo(output.job_detail(job))
    if history is not None:
        click.echo("")
        click.echo(
            output.table(
                ("WHEN", "WHO", "FROM", "TO", "WHAT"),
                [
                    (
                        output.clock(e["at"]),
                        e["actor"] or e["source"],
                        e["from_state"] or "-",
                        e["to_state"] or "-",
                        e["message"],
                    )
                    for e in history
                ],
            )
        )


@cli.command()
@click.argument("idents", metavar="ID...", nargs=-1, required=True)
@pass_state
def cancel(state: State, idents: tuple[str, ...]) -> None:
    """Cancel jobs (42) and whole job arrays (a7), like scancel.

    A waiting job ends at once; a running one is stopped (SIGTERM, its grace,
    SIGKILL). Each ID is tried; the exit code is the first failure's.
    """
    targets = [parse_id(i) for i in idents]  # every id checked before any request
    api = state.api()
    first_failure: CliError | None = None
    for kind, pk in targets:
        try:
            if kind == "array":
                done = api.post(f"arrays/{pk}/cancel/")["cancelled"]
                click.echo(
                    f"Array a{pk}: cancelled {len(done)} task(s)"
                    + (f" ({', '.join(map(str, done))})" if done else "")
                )
            else:
                job = api.post(f"jobs/{pk}/cancel/")
                if job["state"] == "cancelled":
                    click.echo(f"Job {pk}: cancelled")
                else:
                    click.echo(f"Job {pk}: stopping ({job['state']})")
        except CliError as exc:
            label = f"a{pk}" if kind == "array" else str(pk)
            click.echo(f"gpulab: {label}: {exc.format_message()}", err=True)
            first_failure = first_failure or exc
    if first_failure is not None:
        raise click.exceptions.Exit(first_failure.exit_code)


# ------------------------------------------------------------------ logs


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


# ------------------------------------------------------------------ top, usage


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
        width = int(columns) if columns.isdigit() else 120
        view.print_once(api, Console(width=width, highlight=False))
        return
    with _interruptible():
        view.live(api, Console(highlight=False), interval)


@cli.command()
@click.option("--group", help="A group's usage (its leaders and staff).")
@click.option(
    "--from",
    "first",
    type=click.DateTime(["%Y-%m-%d"]),
    help="First UTC day (default: 29 days ago).",
)
@click.option(
    "--to", "last", type=click.DateTime(["%Y-%m-%d"]), help="Last UTC day (today)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@pass_state
def usage(
    state: State,
    *,
    group: str | None,
    first: Any,
    last: Any,
    as_json: bool,
) -> None:
    """GPU-hours used (yours, or a group's) and the quotas that apply."""
    got = state.api().request(
        "GET",
        "usage/",
        params={
            k: v
            for k, v in {
                "group": group,
                "from": first.date().isoformat() if first else None,
                "to": last.date().isoformat() if last else None,
            }.items()
            if v is not None
        },
        fields={"group": "--group", "from": "--from", "to": "--to"},
    )
    click.echo(output.dumps(got) if as_json else output.usage_report(got))


def main() -> None:
    """The ``gpulab`` console script."""
    cli(prog_name="gpulab")
