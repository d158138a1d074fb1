"""Terminals: PTYs on the node for running interactive jobs, carried over the
agent's own websocket (``terminal.*`` frames, ``agents.protocol``).

On ``terminal.open`` for an attempt the agent runs, ``Terminals`` starts the
account's login shell (or ``sh -c COMMAND``) in a new PTY:

- as the job's Unix account (the launch's uid, gid and groups, checked as a batch
  launch is: ``Launcher.preflight``), in the job's workdir, with the job's
  environment and ``CUDA_VISIBLE_DEVICES`` (``agents.shim.build_env``);
- in its own session with the PTY as its controlling terminal, so the line
  discipline turns a Ctrl-C byte into SIGINT for the foreground process group,
  as on a local terminal.

Output is read on the event loop, kept in a bounded scrollback and sent as
``terminal.output`` frames, coalesced for ``COALESCE_S``. Frames are volatile:
while the link is down or congested, output waits in a bounded buffer per
terminal; past ``PENDING_MAX`` bytes the oldest is dropped for a marker that
says how much (the agent never grows without bound for a fast writer). A
``terminal.close`` with ``detach`` (the viewer left: a browser tab closed, a web
process restarting) keeps the PTY for ``linger_s``; opening the same terminal id
again attaches to it and replays the scrollback. The job's end (its exit, a
kill) hangs up its terminals: SIGHUP to the session, SIGKILL to whatever of the
session is left ``HANGUP_GRACE_S`` later. The PTYs belong to the agent's
process: an agent restart hangs them up (the job itself lives on).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import fcntl
import logging
import os
import pwd
import signal
import struct
import subprocess
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agents import protocol as p
from agents.jobtext import normal_workdir
from agents.shim import LaunchError, build_env, resolve_run_as

if TYPE_CHECKING:
    from collections.abc import Callable

    from agents.launcher import Job, Launcher

log = logging.getLogger(__name__)

# Output read within this many seconds goes out in one frame.
COALESCE_S = 0.002
# Output waiting for the link, per terminal; past it the oldest is dropped.
PENDING_MAX = 256 * 1024
# What a viewer gets back on attaching again.
SCROLLBACK_BYTES = 64 * 1024
# After the hang-up, what is left of the terminal's session is killed.
HANGUP_GRACE_S = 2.0
# Terminals one attempt may hold at once.
MAX_PER_ATTEMPT = 64
READ_BYTES = 64 * 1024
# Shells that refuse a login: such an account's terminal gets /bin/sh (the job
# already runs arbitrary commands as the account, a shell grants nothing more).
NO_LOGIN_SHELLS = frozenset({"/usr/sbin/nologin", "/sbin/nologin", "/bin/false"})


@dataclass
class Terminal:
    """One PTY and the process in it."""

    terminal_id: str
    attempt_id: int
    job_id: int
    proc: subprocess.Popen[bytes]
    fd: int  # the PTY's master side, non-blocking
    viewers: set[str] = field(default_factory=set)
    detached_at: float | None = None  # monotonic, while no viewer is attached
    scrollback: bytearray = field(default_factory=bytearray)
    pending: bytearray = field(default_factory=bytearray)
    dropped: int = 0  # bytes dropped from ``pending`` since the last frame
    frames: int = 0  # output frames sent (their ``n``)
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )
    eof: bool = False
    flush_handle: asyncio.TimerHandle | None = None
    kill_at: float | None = None  # monotonic: SIGKILL the session then
    killed: bool = False  # the session got its SIGKILL
    hangup_message: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid


class Terminals:
    """Every terminal of this agent, by id; ``send`` queues a frame on the link
    (``AgentCore._send_volatile``)."""

    def __init__(
        self,
        launcher: Launcher,
        send: Callable[[type[p._Envelope], object], bool],
        *,
        linger_s: float = 300.0,
        scrollback_bytes: int = SCROLLBACK_BYTES,
        require_local_account: bool = False,
    ) -> None:
        self.launcher = launcher
        self.send = send
        self.linger_s = linger_s
        self.scrollback_bytes = scrollback_bytes
        self.require_local_account = require_local_account
        self.by_id: dict[str, Terminal] = {}

    # ------------------------------------------------------------ commands

    def open(self, data: p.TerminalOpenData, job: Job | None) -> None:
        """Start the terminal, or attach to it again (replaying its scrollback)."""
        known = self.by_id.get(data.terminal_id)
        if known is not None:
            if known.attempt_id != data.attempt_id or known.kill_at is not None:
                self._exit_frame(data, None, "this terminal is not open")
                return
            known.viewers.add(data.viewer)
            known.detached_at = None
            self._set_size(known.fd, data.cols, data.rows)
            self._flush(known)  # what was waiting goes first, then the replay
            self._replay(known)
            log.info("terminal %s: attached again", data.terminal_id)
            return
        if job is None or job.outcome is not None or job.stopping:
            self._exit_frame(data, None, "the job is not running on this node")
            return
        if not job.started:
            self._exit_frame(data, None, "the job has not started yet")
            return
        held = sum(1 for t in self.by_id.values() if t.attempt_id == data.attempt_id)
        if held >= MAX_PER_ATTEMPT:
            self._exit_frame(
                data, None, f"the job has {held} terminals open, the most it may have"
            )
            return
        try:
            term = self._spawn(data, job)
        except LaunchError as exc:
            log.info("terminal %s: not started: %s", data.terminal_id, exc)
            self._exit_frame(data, None, str(exc))
            return
        term.viewers.add(data.viewer)
        self.by_id[data.terminal_id] = term
        asyncio.get_running_loop().add_reader(term.fd, self._readable, term)
        log.info(
            "terminal %s of attempt %d: pid %d started",
            data.terminal_id,
            data.attempt_id,
            term.pid,
        )

    def input(self, data: p.TerminalInputData) -> None:
        term = self.by_id.get(data.terminal_id)
        if term is None or term.kill_at is not None:
            return
        payload = data.data.encode("utf-8", "surrogateescape")
        try:
            # Input is small (keystrokes, a paste); a PTY whose input queue is full
            # (nobody reads it) loses what does not fit, as a local one would.
            while payload:
                written = os.write(term.fd, payload)
                payload = payload[written:]
        except BlockingIOError:
            log.debug("terminal %s: input queue full, input dropped", term.terminal_id)
        except OSError:
            pass  # the process is gone; the read side reports the exit

    def resize(self, data: p.TerminalResizeData) -> None:
        term = self.by_id.get(data.terminal_id)
        if term is not None and term.kill_at is None:
            self._set_size(term.fd, data.cols, data.rows)

    def close(self, data: p.TerminalCloseData) -> None:
        term = self.by_id.get(data.terminal_id)
        if term is None:
            return
        if not data.detach:
            self._hang_up(term, "closed by the user")
            return
        term.viewers.discard(data.viewer)
        if not term.viewers:
            term.detached_at = time.monotonic()
            log.info(
                "terminal %s: detached (kept %g s)", term.terminal_id, self.linger_s
            )

    def end_attempt(self, attempt_id: int, why: str) -> None:
        """The attempt ended (or is being stopped): hang up its terminals."""
        for term in list(self.by_id.values()):
            if term.attempt_id == attempt_id and term.kill_at is None:
                self._hang_up(term, why)

    def sweep(self) -> None:
        """Called every reaper tick: detached terminals past their linger are hung
        up; a shell that exited while something it left holds the PTY open has
        that session hung up; hung-up ones are killed after their grace, and
        forgotten once their shell is gone."""
        now = time.monotonic()
        for term in list(self.by_id.values()):
            if term.kill_at is None:
                if (
                    term.detached_at is not None
                    and now - term.detached_at >= self.linger_s
                ):
                    self._hang_up(term, f"no viewer for {self.linger_s:g} s")
                elif not term.eof and term.proc.poll() is not None:
                    term.kill_at = now + HANGUP_GRACE_S
                    _kill_session(term.pid, signal.SIGHUP)
            if term.kill_at is not None and now >= term.kill_at and not term.killed:
                _kill_session(term.pid, signal.SIGKILL)
                term.killed = True
            if term.eof or term.killed:
                self._finish_if_exited(term)

    def pids(self) -> dict[int, int]:
        """Session id (the shell's pid) -> attempt id, for the GPU samples."""
        return {t.pid: t.attempt_id for t in self.by_id.values()}

    # ------------------------------------------------------------ the PTY

    def _spawn(self, data: p.TerminalOpenData, job: Job) -> Terminal:
        spec = self.launcher.read_spec(job)
        launch = p.JobLaunchData.model_validate(spec)
        self.launcher.preflight(launch)
        account = resolve_run_as(spec, require_local=self.require_local_account)
        workdir = normal_workdir(launch.workdir)
        env = build_env(spec)
        kwargs: dict[str, object] = {}
        if account is not None:
            kwargs = {
                "user": account.uid,
                "group": account.gid,
                "extra_groups": account.groups,
            }
            env.update(
                HOME=account.home or workdir, USER=account.name, LOGNAME=account.name
            )
            shell = _login_shell(account.uid if account.home is not None else None)
        else:
            shell = _login_shell(os.geteuid())
        env.update(TERM="xterm-256color", SHELL=shell)
        env.pop("COLUMNS", None)
        env.pop("LINES", None)
        # A leading "-" in argv[0] makes any shell a login shell.
        argv0 = "-" + Path(shell).name
        argv = [argv0] if data.command is None else [argv0, "-c", data.command]
        master, slave = os.openpty()
        try:
            self._set_size(slave, data.cols, data.rows)
            proc = subprocess.Popen(  # type: ignore[call-overload]
                argv,
                executable=shell,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                cwd=workdir,
                env=env,
                close_fds=True,
                start_new_session=True,
                # Runs after setsid and the uid switch: the PTY becomes the
                # session's controlling terminal (Ctrl-C, job control, SIGHUP).
                preexec_fn=_take_controlling_tty,
                **kwargs,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            os.close(master)
            raise LaunchError(f"could not start {shell}: {exc}") from None
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        return Terminal(data.terminal_id, data.attempt_id, data.job_id, proc, master)

    @staticmethod
    def _set_size(fd: int, cols: int, rows: int) -> None:
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def _readable(self, term: Terminal) -> None:
        try:
            chunk = os.read(term.fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError:  # EIO: every process holding the PTY's other side is gone
            chunk = b""
        if not chunk:
            self._eof(term)
            return
        self._keep(term, chunk)
        if not term.viewers:
            return  # kept in the scrollback only: replayed on attaching
        term.pending += chunk
        if len(term.pending) > PENDING_MAX:
            cut = len(term.pending) - PENDING_MAX
            del term.pending[:cut]
            term.dropped += cut
        if term.flush_handle is None:
            term.flush_handle = asyncio.get_running_loop().call_later(
                COALESCE_S, self._flush, term
            )

    def _keep(self, term: Terminal, chunk: bytes) -> None:
        term.scrollback += chunk
        excess = len(term.scrollback) - self.scrollback_bytes
        if excess > 0:
            # Start the kept text at a line when one starts soon after the cut, so
            # the replay does not begin inside an escape sequence.
            newline = term.scrollback.find(b"\n", excess, excess + 4096)
            del term.scrollback[: newline + 1 if newline >= 0 else excess]

    def _flush(self, term: Terminal) -> None:
        term.flush_handle = None
        if not term.pending and not term.dropped:
            return
        text = ""
        if term.dropped:
            text = f"\r\n[gpulab: {term.dropped} bytes of output skipped]\r\n"
        text += term.decoder.decode(bytes(term.pending))
        sent = self._send_text(term, text, replay=False)
        if sent:
            term.pending.clear()
            term.dropped = 0
        else:
            # The link is down or congested: try again shortly.
            term.decoder.reset()
            term.flush_handle = asyncio.get_running_loop().call_later(
                0.05, self._flush, term
            )

    def _send_text(self, term: Terminal, text: str, *, replay: bool) -> bool:
        step = p.MAX_TERMINAL_CHARS
        for start in range(0, max(len(text), 1), step):
            frame = p.TerminalOutputData(
                terminal_id=term.terminal_id,
                job_id=term.job_id,
                data=text[start : start + step],
                replay=replay and start == 0,
                n=term.frames + 1,
            )
            if not self.send(p.TerminalOutput, frame):
                return False
            term.frames += 1
        return True

    def _replay(self, term: Terminal) -> None:
        text = bytes(term.scrollback).decode("utf-8", "replace")
        self._send_text(term, text, replay=True)

    def _eof(self, term: Terminal) -> None:
        term.eof = True
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(term.fd)
        if term.flush_handle is not None:
            term.flush_handle.cancel()
            term.flush_handle = None
        self._flush(term)
        self._finish_if_exited(term)

    def _finish_if_exited(self, term: Terminal) -> None:
        code = term.proc.poll()
        if code is None or not (term.eof or term.killed):
            if code is None and term.eof and term.kill_at is None:
                # The PTY closed but the shell has not exited yet: check again.
                asyncio.get_running_loop().call_later(
                    0.05, self._finish_if_exited, term
                )
            return
        if self.by_id.get(term.terminal_id) is not term:
            return
        del self.by_id[term.terminal_id]
        if not term.eof:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(term.fd)
        if term.flush_handle is not None:
            term.flush_handle.cancel()
            self._flush(term)
        with contextlib.suppress(OSError):
            os.close(term.fd)
        status = 128 - code if code < 0 else code
        # Hung up: the shell's status (SIGHUP's) says nothing the message does not.
        exit_code = None if term.hangup_message else status
        self.send(
            p.TerminalExit,
            p.TerminalExitData(
                terminal_id=term.terminal_id,
                job_id=term.job_id,
                code=exit_code,
                message=term.hangup_message,
            ),
        )
        log.info(
            "terminal %s ended (status %d%s)",
            term.terminal_id,
            status,
            f", {term.hangup_message}" if term.hangup_message else "",
        )

    def _hang_up(self, term: Terminal, why: str) -> None:
        log.info("terminal %s: hanging up (%s)", term.terminal_id, why)
        term.hangup_message = f"terminal hung up: {why}"
        term.kill_at = time.monotonic() + HANGUP_GRACE_S
        _kill_session(term.pid, signal.SIGHUP)
        _kill_session(term.pid, signal.SIGCONT)

    def _exit_frame(self, data: p.TerminalOpenData, code: int | None, why: str) -> None:
        self.send(
            p.TerminalExit,
            p.TerminalExitData(
                terminal_id=data.terminal_id, job_id=data.job_id, code=code, message=why
            ),
        )


def _take_controlling_tty() -> None:
    """In the shell's child, before its exec: the PTY becomes its controlling
    terminal, and the terminal's signals (Ctrl-C, Ctrl-\\, hang-up) get their
    default action back, should the agent have been started with them ignored
    (``nohup``, a background job): ignored signals stay ignored across exec."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _login_shell(uid: int | None) -> str:
    """The account's shell from the node's user database, else /bin/sh."""
    shell = ""
    if uid is not None:
        with contextlib.suppress(KeyError):
            shell = pwd.getpwuid(uid).pw_shell
    if not shell or shell in NO_LOGIN_SHELLS or not os.access(shell, os.X_OK):
        return "/bin/sh"
    return shell


def session_members(sid: int) -> list[int]:
    """Pids of the live processes in session ``sid`` (from /proc; zombies,
    already dead, are left out)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces or ")".
        rest = text[text.rindex(")") + 2 :].split()
        if int(rest[3]) == sid and rest[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _kill_session(sid: int, sig: int) -> None:
    """Signal every process of the terminal's session (its shell, the foreground
    and background groups the shell started)."""
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
