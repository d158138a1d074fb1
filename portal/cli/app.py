"""The ``gpulab`` command group and what every command shares: the
``--server`` option, the API client it resolves (``State``) and the exit codes
the help lists. The commands register themselves on ``cli`` in their modules;
``portal.cli.main`` imports them all."""

from __future__ import annotations

import os

import click

from portal.cli import config
from portal.cli.client import Api, cli_version
from portal.cli.errors import CliError, Exit

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
    gpulab login                      sign in through the browser (--token: paste one)
    gpulab submit --gpus 2 --time 4h -- python train.py --lr 0.1
    gpulab ls / gpulab queue          my jobs / the whole queue
    gpulab logs -f 42                 follow a job's output to its end
    gpulab top                        the cluster, live
    """
    state = State(server)
    ctx.obj = state
    ctx.call_on_close(state.close)
