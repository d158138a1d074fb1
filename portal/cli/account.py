"""``gpulab login``, ``logout``, ``whoami`` and ``usage``: the stored token, who
it signs in as, and the GPU-hours used."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from portal.cli import config, output
from portal.cli.app import State, cli, pass_state
from portal.cli.client import Api
from portal.cli.errors import CliError, Exit

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


# ------------------------------------------------------------------ usage


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
