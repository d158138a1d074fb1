"""``gpulab login``, ``logout``, ``whoami`` and ``usage``: the stored token, who
it signs in as, and the GPU-hours used."""

from __future__ import annotations

import os
import socket
import sys
import time
import webbrowser
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


def _machine_name() -> str:
    """This machine's host name: the approval page shows it, the token is
    named after it."""
    name = "".join(c for c in socket.gethostname() if c.isprintable()).strip()
    return name[:100] or "unnamed machine"


def _open_browser(url: str) -> bool:
    """Open ``url`` in a graphical browser where one can be started; never
    fails, never starts a text browser in this terminal (Python's webbrowser
    falls back to lynx or w3m, which would take the terminal over and block)."""
    if sys.platform.startswith("linux") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    ):
        return False
    try:
        browser = webbrowser.get()
        if type(browser) is webbrowser.GenericBrowser:  # a console browser
            return False
        return bool(browser.open(url))
    except Exception:  # any failure: the user opens the page by hand
        return False


def _browser_login(server: str, name: str, *, open_browser: bool) -> str:
    """RFC 8628's device authorization grant: ask for a code, show it and the
    approval page, poll until the user approves (a token) or denies, or the
    code expires (a ``CliError``)."""
    api = Api(server, None)
    try:
        got = api.post(
            "device/code/", {"client_name": name}, fields={"client_name": "--name"}
        )
        minutes = max(1, round(int(got["expires_in"]) / 60))
        click.echo(
            f"To sign in, open {got['verification_uri']} and enter the code"
            f" {got['user_code']}\n"
            f"(or open {got['verification_uri_complete']})"
        )
        if open_browser and _open_browser(got["verification_uri_complete"]):
            click.echo("Opened it in your browser.")
        click.echo(
            f"Waiting for you to approve it there (the code expires in"
            f" {minutes} min; Ctrl-C to give up)..."
        )
        interval = float(got["interval"])
        deadline = time.monotonic() + int(got["expires_in"])
        body = {"device_code": got["device_code"]}
        while True:
            time.sleep(interval)
            code, answer = api.exchange("device/token/", body)
            if code < 300:
                return str(answer["access_token"])
            error = answer.get("error")
            if error == "authorization_pending":
                pass
            elif error in ("slow_down", "throttled"):
                interval += 5  # RFC 8628 3.5: for this and every later poll
            elif error == "access_denied":
                raise CliError(
                    Exit.AUTH, "the sign-in was denied on the portal; nothing stored"
                )
            elif error == "expired_token":
                raise CliError(
                    Exit.AUTH,
                    "the code expired before it was approved; run 'gpulab login' again",
                )
            else:
                raise CliError(Exit.AUTH, str(answer.get("detail") or error))
            if time.monotonic() > deadline:
                raise CliError(
                    Exit.AUTH,
                    "the code expired before it was approved; run 'gpulab login' again",
                )
    finally:
        api.close()


@cli.command()
@click.option(
    "--token",
    "paste",
    is_flag=True,
    help="Paste a token from the Tokens page instead (asked without echo, or"
    " the first line of stdin).",
)
@click.option(
    "--browser",
    "web",
    is_flag=True,
    help="Sign in through the browser even when stdin is not a terminal.",
)
@click.option(
    "--no-open",
    is_flag=True,
    help="Do not try to open the approval page; only print its address.",
)
@click.option(
    "--name",
    help="The name of the new token (default: this machine's host name).",
)
@click.pass_context
def login(
    ctx: click.Context, *, paste: bool, web: bool, no_open: bool, name: str | None
) -> None:
    """Sign in to a server and store a token for it.

    On a terminal: prints a short code and the address of the portal's approval
    page (and opens it in your browser where it can); approve the code there,
    signed in, and gpulab receives a token of its own, named after this
    machine, listed on the Tokens page (revoke it there), expiring as the
    portal's tokens do.

    With --token, or when stdin is not a terminal and --browser is not given
    (scripts: echo "$TOKEN" | gpulab --server URL login), it takes a token
    created on the Tokens page instead.

    The server comes from --server, $GPULAB_SERVER, or a prompt. The token is
    checked with the server before it is stored, in your config directory,
    readable by you only (mode 600), for that server only.
    """
    state: State = ctx.obj
    if paste and web:
        raise CliError(Exit.USAGE, "give --token or --browser, not both")
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
    if paste or not (web or sys.stdin.isatty()):
        token = _read_token()
        if not token:
            raise CliError(
                Exit.USAGE,
                "no token given; run 'gpulab login' on a terminal to sign in through"
                " the browser, or create a token on the Tokens page",
            )
    else:
        token = _browser_login(
            server, name or _machine_name(), open_browser=not no_open
        )
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
