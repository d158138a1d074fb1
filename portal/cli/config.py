"""Where ``gpulab`` finds its server and token.

``gpulab login`` stores, in ``<user config dir>/gpulab/config.json`` (XDG:
``$XDG_CONFIG_HOME/gpulab``, else ``~/.config/gpulab``; platformdirs elsewhere),
the server last logged in to and one token per server, the file mode 600 in a
directory of mode 700. A token is only ever sent to the server it was stored
for: ``--server`` pointing elsewhere needs a login there (or ``GPULAB_TOKEN``).

Precedence: ``--server``, then ``GPULAB_SERVER``, then the stored server;
``GPULAB_TOKEN``, then the token stored for that server.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import platformdirs

from portal.cli.errors import CliError, Exit

if TYPE_CHECKING:
    from collections.abc import Mapping

SERVER_ENV = "GPULAB_SERVER"
TOKEN_ENV = "GPULAB_TOKEN"
DEFAULT_SERVER = "http://127.0.0.1:8000"


def config_path() -> Path:
    return Path(platformdirs.user_config_dir("gpulab", appauthor=False)) / (
        "config.json"
    )


def normalise_server(raw: str) -> str:
    """``https://portal.lab/`` -> ``https://portal.lab``; a usage error naming
    what is wrong for anything that is not an http(s) URL with a host."""
    text = raw.strip().rstrip("/")
    text = text.removesuffix("/api/v1").rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(
            Exit.USAGE,
            f"the server {raw!r} is not a URL like https://portal.lab.example or"
            f" {DEFAULT_SERVER}",
        )
    if parts.query or parts.fragment:
        raise CliError(Exit.USAGE, f"the server {raw!r} has a query or fragment")
    return text


def is_loopback(server: str) -> bool:
    host = urlsplit(server).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass
class Stored:
    """The config file's content."""

    server: str | None = None
    tokens: dict[str, str] = field(default_factory=dict)


def load(path: Path | None = None) -> Stored:
    """The stored config; empty when there is none. A file others may read is
    still used (it is the user's), with a warning to fix its mode."""
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Stored()
    except OSError as exc:
        raise CliError(Exit.USAGE, f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
        server = data.get("server")
        tokens = data.get("tokens", {})
        if not (server is None or isinstance(server, str)) or not (
            isinstance(tokens, dict)
            and all(isinstance(v, str) for v in tokens.values())
        ):
            raise ValueError("unexpected content")
    except (ValueError, AttributeError):
        raise CliError(
            Exit.USAGE,
            f"{path} is not a gpulab config file; remove it and run 'gpulab login'",
        ) from None
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        import click

        click.echo(
            f"gpulab: warning: {path} (it holds your tokens) is readable by others"
            f" (mode {mode:o}); run 'chmod 600 {path}'",
            err=True,
        )
    return Stored(server=server, tokens=dict(tokens))


def save(stored: Stored, path: Path | None = None) -> Path:
    """Write the config atomically, mode 600 from its creation (never readable
    by others, not even for an instant), in a directory of mode 700."""
    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps({"server": stored.server, "tokens": stored.tokens}, indent=2)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is cut by the umask; never widened
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(data + "\n")
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


@dataclass(frozen=True)
class Target:
    """The server to talk to and the token for it (None: not logged in)."""

    server: str
    token: str | None


def resolve(option: str | None, env: Mapping[str, str]) -> Target:
    """The server and token for a command (see the module's precedence)."""
    stored = load()
    raw = option or env.get(SERVER_ENV) or stored.server
    if not raw:
        raise CliError(
            Exit.AUTH,
            f"not logged in: run 'gpulab login' (or give --server and set {TOKEN_ENV})",
        )
    server = normalise_server(raw)
    token = env.get(TOKEN_ENV) or stored.tokens.get(server)
    return Target(server, token.strip() if token else None)
