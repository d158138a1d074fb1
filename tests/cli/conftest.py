"""The ``gpulab`` command line against a live server: pytest-django's
``live_server`` runs the real Django app (every middleware, the API, the
Redis rate limit) on this run's PostgreSQL test database; click's CliRunner
runs the commands in process, with their own config directory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner, Result

from portal.api import tokens
from portal.cli.main import cli

if TYPE_CHECKING:
    from pathlib import Path

    from django.contrib.auth.models import User


@dataclass
class Gpulab:
    """``gpulab ARGS`` as ``user`` (their token in GPULAB_TOKEN) on the live
    server; ``token=None`` runs it with what ``gpulab login`` stored."""

    server: str
    config_home: Path
    secrets: dict[str, str]

    def token_of(self, user: User) -> str:
        """The user's token (made once per test, named 'cli')."""
        if user.username not in self.secrets:
            self.secrets[user.username] = tokens.create_token(user, "cli", None)[1]
        return self.secrets[user.username]

    def __call__(
        self,
        *args: str,
        user: User | None = None,
        server: str | None = "",
        input: str | None = None,
        env: dict[str, str | None] | None = None,
    ) -> Result:
        environ: dict[str, str | None] = {
            "XDG_CONFIG_HOME": str(self.config_home),
            "GPULAB_SERVER": self.server if server == "" else server,
            "GPULAB_TOKEN": self.token_of(user) if user is not None else None,
            "COLUMNS": "160",
            **(env or {}),
        }
        return CliRunner().invoke(
            cli,
            list(args),
            env=environ,
            input=input,
            catch_exceptions=False,
            prog_name="gpulab",
        )


@pytest.fixture
def gpulab(live_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Gpulab:
    # `gpulab submit` runs a job in the current directory by default: one under
    # /tmp, as a user's would be under /home (GPULAB_WORKDIR_ALLOWED).
    monkeypatch.chdir(tmp_path)
    return Gpulab(live_server.url, tmp_path / "config", {})
