"""What every part of the node agent shares: its configuration, its state (the
jobs it holds, the spool, the sequence counter, the per-connection send window)
and how a frame is made: durable (spooled, fsynced, kept until acked) or live
(sent only while connected). The parts: ``agents.reaper`` (the job directories),
``agents.link`` (the connection), ``agents.agent`` (commands, samples, the
supervisor)."""

from __future__ import annotations

import abc
import asyncio
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agents.launcher import Job, Launcher
from agents.spool import SeqCounter, Spool
from agents.statedir import StateDir
from agents.terminal import Terminals

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from agents import protocol as p
    from agents.nvml import GpuReader

AGENT_VERSION = "0.1.0"
DONE_MEMORY = 4096  # finished attempts remembered to answer repeated launches
# Volatile frames (terminal output) queued for the link beyond this wait: the
# terminal keeps its output (bounded) and tries again.
VOLATILE_BACKLOG = 400


class SimHooks(Protocol):
    def attach(
        self, attempt_id: int, gpu_uuids: list[str], pid: int, env: dict[str, str]
    ) -> None: ...

    def detach(self, attempt_id: int) -> None: ...


@dataclass
class Config:
    server: str
    token: str
    state_dir: Path
    heartbeat_s: float = 5.0
    sample_interval_s: float = 1.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 20.0
    reap_interval_s: float = 0.25
    allow_root_jobs: bool = False
    hostname: str = ""
    # Jobs without run_as run as this account when the agent is root.
    default_account: str | None = None
    # A launch's uid/gid (from the lab's directory) must match this node's own
    # user database (else the job fails to launch, saying why).
    require_local_account: bool = False
    # While disconnected: one metrics frame per this many seconds goes to the spool.
    spool_metrics_interval_s: float = 10.0
    spool_max_bytes: int = 64 * 1024 * 1024
    # Stop every job once the link has been down this long (None: never).
    kill_after_disconnect_s: float | None = None
    # A portal unreachable this long (from the first failed try, or from the
    # loss of a link) is worth a warning; a shorter wait, such as the web server
    # still starting, is logged at INFO once and each retry at DEBUG.
    warn_unreachable_after_s: float = 60.0
    # A terminal with no viewer is hung up after this long (agents.terminal).
    terminal_linger_s: float = 300.0


class AgentCore(abc.ABC):
    """The agent's state and its frames; ``Agent`` is the whole agent."""

    def __init__(
        self, config: Config, reader: GpuReader, sim: SimHooks | None = None
    ) -> None:
        self.config = config
        self.reader = reader
        self.sim = sim
        self.hostname = config.hostname or socket.gethostname()
        self.incarnation = uuid.uuid4().hex
        self.shutdown = asyncio.Event()
        self.state = StateDir(config.state_dir)
        self.state.ensure()
        self.launcher = Launcher(
            self.state,
            allow_root_jobs=config.allow_root_jobs,
            default_account=config.default_account,
            require_local_account=config.require_local_account,
        )
        self.spool = Spool(self.state.spool, max_bytes=config.spool_max_bytes)
        self.seq = SeqCounter(self.state.agent_json, floor=self.spool.max_seq)
        self.jobs: dict[int, Job] = {}
        self.terminals = Terminals(
            self.launcher,
            self._send_volatile,
            linger_s=config.terminal_linger_s,
            require_local_account=config.require_local_account,
        )
        self.done: dict[int, p.JobExitedData] = {}
        self.connected = False
        self.down_since = time.monotonic()  # when the link last went down
        # The first sample is spooled one interval after the link went down (a blip
        # shorter than that spools nothing), then one per interval.
        self._last_spooled_sample = self.down_since
        self._wake = asyncio.Event()
        self._live: list[tuple[int, str]] = []  # (seq, frame), sent in seq order
        # Per connection, only while durable frames are in flight (pruned on every
        # ack): seq -> position in send order, and (position, seq, durable) of every
        # frame sent since the oldest unacked durable one, in send order.
        self._sent_pos: dict[int, int] = {}
        self._sent: deque[tuple[int, int, bool]] = deque()
        self._in_flight = 0  # durable frames sent on this connection, not acked
        self._send_count = 0

    # ------------------------------------------------------------ frames

    def _frame(self, cls: Callable[..., p._Envelope], data: Any) -> tuple[int, str]:
        seq = self.seq.take()
        return seq, cls(seq=seq, ts=time.time(), data=data).model_dump_json()

    def _durable(self, cls: Callable[..., p._Envelope], data: Any) -> int:
        """Spool a frame (fsynced) and wake the sender; returns its seq."""
        seq, frame = self._frame(cls, data)
        self.spool.append(seq, frame)
        self._wake.set()
        return seq

    def _send_live(self, cls: Callable[..., p._Envelope], data: Any) -> None:
        """Queue a frame that is only worth sending now (metrics, heartbeat)."""
        if self.connected and len(self._live) < 100:
            # The seq is taken now, so that frames go out in seq order (the sender
            # merges these with the spool) except for the replay after hello.
            self._live.append(self._frame(cls, data))
            self._wake.set()

    def _send_volatile(self, cls: Callable[..., p._Envelope], data: Any) -> bool:
        """Queue a terminal frame if the link can take it now; False if it is
        down or has ``VOLATILE_BACKLOG`` frames waiting (the caller keeps it)."""
        if not self.connected or len(self._live) >= VOLATILE_BACKLOG:
            return False
        self._live.append(self._frame(cls, data))
        self._wake.set()
        return True

    def running(self) -> list[Job]:
        return [
            j for j in self.jobs.values() if j.outcome is None and j.exit_seq is None
        ]

    def held(self) -> list[Job]:
        """Every attempt this agent holds: running, or ended with its exit not yet
        acknowledged. What hello and heartbeats list, so that the portal's
        reconciler never takes an exit on its way for a vanished job."""
        return list(self.jobs.values())

    # ------------------------------------------------------------ the server's commands

    @abc.abstractmethod
    def on_launch(self, data: p.JobLaunchData) -> None:
        """Start a job (``job.launch``)."""

    @abc.abstractmethod
    def on_kill(self, data: p.JobKillData) -> None:
        """Stop a job (``job.kill``)."""

    @abc.abstractmethod
    def on_terminal(
        self,
        msg: p.TerminalOpen | p.TerminalInput | p.TerminalResize | p.TerminalClose,
    ) -> None:
        """A terminal command (``terminal.*``, ``agents.terminal``)."""

    @abc.abstractmethod
    def on_ack(self, seq: int) -> None:
        """The server processed the frames up to ``seq`` on this connection."""
