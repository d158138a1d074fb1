"""The terminal of an interactive job in the user's own terminal: the websocket
client behind ``gpulab shell`` (``portal.terminal.consumers`` is the server).

The local tty is put in raw mode for the session, so every key, Ctrl-C
included, goes to the remote PTY as a byte: the remote line discipline turns
Ctrl-C into SIGINT for the remote foreground process group, as with ``ssh``.
Window size changes (SIGWINCH) are sent as ``resize``. The remote shell's exit
status is returned. Without a tty (a pipe), stdin is sent as it comes and the
size is the default 80x24.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import termios
import tty
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from portal.cli.errors import CliError, Exit

if TYPE_CHECKING:
    from collections.abc import Iterator

    from websockets.asyncio.client import ClientConnection

# The close codes of portal.terminal.consumers.
CLOSE_NOT_FOUND = 4404
CLOSE_NOT_RUNNING = 4409
# Reconnects after the connection drops (a web process restarting), and the
# longest pause between two tries.
RECONNECTS = 30
RECONNECT_PAUSE_S = 1.0
# The most characters one input message carries.
INPUT_CHUNK = 16 * 1024


def websocket_url(server: str, job_id: int) -> str:
    """``http(s)://host[:port]`` -> the job's terminal websocket."""
    scheme, sep, rest = server.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise CliError(Exit.USAGE, f"server {server!r} is not an http(s) URL")
    ws = "wss" if scheme == "https" else "ws"
    return f"{ws}://{rest.rstrip('/')}/ws/interactive/{job_id}/terminal/"


@dataclass
class Ended:
    """How the remote terminal ended."""

    code: int | None
    message: str


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """The tty ``fd`` in raw mode while inside; restored however it ends."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        size = shutil.get_terminal_size()
    return max(1, size.columns), max(1, size.lines)


class Session:
    """One viewer's connection (and re-connections) to one terminal."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        command: str | None,
        stdin: int,
        stdout: BinaryIO,
    ) -> None:
        self.url = url
        self.token = token
        self.command = command
        self.stdin = stdin
        self.stdout = stdout
        self.terminal_id: str | None = None
        self.ws: ClientConnection | None = None
        self.stdin_closed = False

    async def run(self) -> Ended:
        loop = asyncio.get_running_loop()
        ended: Ended | None = None
        tries = 0
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGWINCH, self._resized)
        try:
            while ended is None:
                try:
                    ended = await self._connection()
                    tries = 0
                except (ConnectionClosed, OSError) as exc:
                    if self.terminal_id is None or tries >= RECONNECTS:
                        raise CliError(
                            Exit.NETWORK, f"terminal connection lost: {exc}"
                        ) from None
                    tries += 1
                    await asyncio.sleep(RECONNECT_PAUSE_S)
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGWINCH)
        return ended

    async def _connection(self) -> Ended | None:
        """One websocket: open (or attach again), then relay until the remote
        terminal ends (its ``Ended``) or the connection drops (raises)."""
        try:
            ws = await connect(
                self.url,
                additional_headers={"Authorization": f"Bearer {self.token}"},
                open_timeout=15,
                close_timeout=2,
                max_size=2**20,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise CliError(
                Exit.AUTH if status in (401, 403) else Exit.SERVER,
                f"the portal refused the terminal: HTTP {status}",
            ) from None
        except InvalidURI as exc:
            raise CliError(Exit.USAGE, str(exc)) from None
        self.ws = ws
        loop = asyncio.get_running_loop()
        try:
            cols, rows = _size(self.stdin)
            hello: dict[str, Any] = {"type": "open", "cols": cols, "rows": rows}
            if self.terminal_id is not None:
                hello["terminal"] = self.terminal_id
            elif self.command is not None:
                hello["command"] = self.command
            await ws.send(json.dumps(hello))
            async for raw in ws:
                message = json.loads(raw)
                kind = message.get("type")
                if kind == "opened":
                    self.terminal_id = message["terminal"]
                    # Keys go out once the portal knows the terminal.
                    if not self.stdin_closed:
                        loop.add_reader(self.stdin, self._stdin_readable)
                elif kind == "output":
                    data = message["data"]
                    if message.get("replay"):
                        # Attached again: what the screen showed, redrawn.
                        data = "\x1b[H\x1b[2J" + data
                    self.stdout.write(data.encode("utf-8", "replace"))
                    self.stdout.flush()
                elif kind == "exit":
                    return Ended(message.get("code"), message.get("message", ""))
                elif kind == "error":
                    sys.stderr.write(f"gpulab: {message.get('message')}\r\n")
            code = ws.close_code
            if code == CLOSE_NOT_FOUND:
                raise CliError(Exit.NOT_FOUND, "no such interactive job visible to you")
            if code == CLOSE_NOT_RUNNING:
                return Ended(None, "the job is not running")
            raise OSError(f"closed by the portal (code {code})")
        finally:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self.stdin)
            self.ws = None
            await ws.close()

    def _stdin_readable(self) -> None:
        try:
            data = os.read(self.stdin, INPUT_CHUNK)
        except OSError:
            data = b""
        loop = asyncio.get_running_loop()
        if not data:
            # End of a piped stdin: nothing more to send; ^D tells the shell so.
            self.stdin_closed = True
            loop.remove_reader(self.stdin)
            data = b"\x04"
        self._send({"type": "input", "data": data.decode("utf-8", "replace")})

    def _resized(self) -> None:
        cols, rows = _size(self.stdin)
        self._send({"type": "resize", "cols": cols, "rows": rows})

    def _send(self, message: dict[str, Any]) -> None:
        if self.ws is not None and self.terminal_id is not None:
            ws = self.ws
            task = asyncio.get_running_loop().create_task(ws.send(json.dumps(message)))
            task.add_done_callback(_ignore_failure)


def _ignore_failure(task: asyncio.Task[None]) -> None:
    # A send on a connection that just dropped: the reconnect takes over.
    if not task.cancelled():
        task.exception()


def attach(
    server: str, token: str, job_id: int, *, command: str | None = None
) -> Ended:
    """Relay this process's stdin/stdout to a new terminal of job ``job_id`` (or
    run ``command`` there) until it ends; the local tty is raw meanwhile."""
    session = Session(
        websocket_url(server, job_id),
        token,
        command=command,
        stdin=sys.stdin.fileno(),
        stdout=sys.stdout.buffer,
    )
    with raw_mode(session.stdin):
        return asyncio.run(session.run())
