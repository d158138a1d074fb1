"""``gpulab ls``, ``queue``, ``show`` and ``cancel``: listing jobs and acting on
them by id (``42`` a job, ``a7`` an array)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from portal.cli import output
from portal.cli.app import State, cli, pass_state
from portal.cli.errors import CliError

if TYPE_CHECKING:
    from portal.cli.client import Api


# ------------------------------------------------------------------ ls, queue


JOBS_PAGE = 1000  # the API's smallest allowed maximum page (GPULAB_API_MAX_PAGE)


def _pages(api: Api, limit: int, **params: Any) -> list[Any]:
    """Up to ``limit`` jobs, newest first, a page at a time, each page from the
    last id of the one before (``before``: a deep page then costs the server
    what a first one does; an offset's cost grows with the jobs it skips)."""
    jobs: list[Any] = []
    while len(jobs) < limit:
        page = api.get(
            "jobs/",
            limit=min(JOBS_PAGE, limit - len(jobs)),
            before=jobs[-1]["id"] if jobs else None,
            **params,
        )
        jobs += page["results"]
        if not page["next"] or not page["results"]:
            break
    return jobs


QUEUE_PAGE = 1000  # the API's smallest allowed maximum page (GPULAB_API_MAX_PAGE)


def whole_queue(api: Api) -> list[Any]:
    """Every running and waiting job, following the queue's pages (a job that
    starts or ends between two pages may be listed twice or not at all)."""
    jobs: list[Any] = []
    while True:
        page = api.get("queue/", limit=QUEUE_PAGE, offset=len(jobs))
        jobs += page
        if len(page) < QUEUE_PAGE:
            return jobs


def _array_param(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip().lower().removeprefix("a")
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 2**62:
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
    wanted = (
        ",".join(p.strip().lower() for p in states.split(",") if p.strip())
        if states is not None
        else (None if show_all else "active")
    )
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
    jobs = whole_queue(state.api())
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
    if not (digits.isascii() and digits.isdigit()) or not 0 < int(digits) < 2**62:
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
