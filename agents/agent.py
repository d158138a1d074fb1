"""The node agent's supervisor: one asyncio TaskGroup of sampler, heartbeat, link, reaper.

- ``link``: connect (Bearer token) -> ``hello`` -> replay the spool -> send and receive
  until the connection drops; reconnect with exponential backoff and full jitter
  (base 1 s, cap 60 s, reset after the link stayed up 30 s). It retries forever: the
  jobs keep running, and the server's ``node_lost_after`` decides when they are lost.
- ``reaper``: watches job directories; spools ``job.started``, ``job.log``,
  ``job.exited`` (durable: on disk until the server acks them) and ``job.progress``
  (the job's ``GPULAB_PROGRESS`` lines, ``agents.progress``: at most one per job
  every 10 s and a last one before the exit; droppable like metric samples). It
  also stops a job at its time limit (``time_limit_s`` after the start reported in
  ``job.started``, read back from the job directory after a restart; reported as
  reason ``timeout``), and, with ``kill_after_disconnect_s``, every job once the link
  has been down that long.
- ``sampler`` / ``heartbeat``: live ``metrics`` and ``heartbeat`` frames. While
  disconnected, heartbeats are dropped and one metrics frame every
  ``spool_metrics_interval_s`` goes to the spool (capped at ``spool_max_bytes``, the
  oldest samples dropped first), replayed with its original ``sampled_at``.

SIGTERM/SIGINT set ``shutdown``; the agent closes the websocket and returns, never
killing jobs (their shims run in their own sessions).

``Agent`` is assembled from parts that share ``agents.core.AgentCore`` (the
configuration, the state and how frames are made): ``agents.reaper`` (the job
directories: ``reaper``), ``agents.link`` (the connection: ``link``); this module
holds the recovery at start, the server's commands, the samples (``sampler``,
``heartbeat``) and the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING

from agents import protocol as p
from agents.core import AGENT_VERSION, DONE_MEMORY, AgentCore, Config, SimHooks
from agents.link import Link, backoff_delay
from agents.reaper import Reaper

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from agents.nvml import GpuReader

log = logging.getLogger(__name__)

__all__ = ["AGENT_VERSION", "Agent", "AgentCore", "Config", "SimHooks", "backoff_delay"]


class Agent(Reaper, Link):
    """The node agent: recovers its jobs from the state directory, obeys the
    server's commands, samples the GPUs, and supervises its four loops."""

    def __init__(
        self, config: Config, reader: GpuReader, sim: SimHooks | None = None
    ) -> None:
        super().__init__(config, reader, sim)
        self._recover()

    # ------------------------------------------------------------ recovery

    def _recover(self) -> None:
        """Rebuild jobs from the state dir (re-attach after a restart).

        1. frames still in the spool are pending: a job whose ``job.exited`` is there
           only waits for the ack;
        2. every other job is polled by the reaper as usual: an ``exit_code`` present
           is reported, a live shim (same pid and start time) is adopted, a shim gone
           without a result is reported ``lost``.
        """
        pending_exit: dict[int, int] = {}
        for seq, frame in self.spool.pending():
            msg = json.loads(frame)
            if msg.get("type") == "job.exited":
                pending_exit[msg["data"]["attempt_id"]] = seq
        for job in self.launcher.scan():
            job.exit_seq = pending_exit.get(job.attempt_id)
            self.jobs[job.attempt_id] = job
            if job.exit_seq is None and job.started and self.sim and job.pgid:
                self.sim.attach(job.attempt_id, job.gpu_uuids, job.pgid, job.env)
            log.info(
                "recovered attempt %d (job %d)%s",
                job.attempt_id,
                job.job_id,
                ": exit not acked yet" if job.exit_seq else "",
            )

    # ------------------------------------------------------------ commands

    def on_launch(self, data: p.JobLaunchData) -> None:
        """Start a job; a repeated launch only re-sends what we know (idempotent)."""
        known = self.jobs.get(data.attempt_id)
        if known is not None:
            if known.outcome is not None:
                self._report_exit(known, known.outcome, resend=True)
            elif known.started and known.pgid is not None:
                self._report_started(known, resend=True)
            log.info("attempt %d: repeated launch, already known", data.attempt_id)
            return
        if data.attempt_id in self.done:
            self._durable(p.JobExited, self.done[data.attempt_id])
            return
        log.info(
            "attempt %d (job %d, %r): launching on %s",
            data.attempt_id,
            data.job_id,
            data.name,
            ",".join(data.gpu_uuids) or "no GPU",
        )
        self.jobs[data.attempt_id] = self.launcher.launch(data)
        self._reap(self.jobs[data.attempt_id])

    def on_terminal(
        self,
        msg: p.TerminalOpen | p.TerminalInput | p.TerminalResize | p.TerminalClose,
    ) -> None:
        if isinstance(msg, p.TerminalInput):
            self.terminals.input(msg.data)
        elif isinstance(msg, p.TerminalOpen):
            self.terminals.open(msg.data, self.jobs.get(msg.data.attempt_id))
        elif isinstance(msg, p.TerminalResize):
            self.terminals.resize(msg.data)
        else:
            self.terminals.close(msg.data)

    def on_kill(self, data: p.JobKillData) -> None:
        self.terminals.end_attempt(data.attempt_id, f"the job was {data.reason}")
        job = self.jobs.get(data.attempt_id)
        if job is None:
            if data.attempt_id in self.done:
                self._durable(p.JobExited, self.done[data.attempt_id])
                return
            log.info("kill for unknown attempt %d: never started", data.attempt_id)
            self._durable(
                p.JobExited,
                p.JobExitedData(
                    attempt_id=data.attempt_id,
                    job_id=data.job_id,
                    exit_code=None,
                    ended_at=time.time(),
                    reason="never_started",
                    message="this node never launched the attempt",
                ),
            )
            return
        if job.outcome is None:
            log.info(
                "attempt %d: kill (%s, SIG%s, grace %d s)",
                data.attempt_id,
                data.reason,
                data.signal,
                data.grace_s,
            )
            self.launcher.kill(job, data.grace_s, data.reason, sig=data.signal)

    def on_ack(self, seq: int) -> None:
        """Drop what the server has processed.

        The server processes one connection's frames in order, so an ack for a frame
        we sent covers every durable frame sent before it on this connection. Seqs are
        not in send order after a reconnect (hello, then the older spool), so the
        position in send order decides, never the seq alone. An ack for a frame not
        sent on this connection is ignored: its frames are replayed and de-duplicated.
        """
        pos = self._sent_pos.get(seq)
        if pos is None:
            log.debug("ack %d for a frame not sent on this connection", seq)
            return
        acked: list[int] = []
        while self._sent and self._sent[0][0] <= pos:
            _, sent_seq, durable = self._sent.popleft()
            self._sent_pos.pop(sent_seq, None)
            if durable:
                acked.append(sent_seq)
        self._in_flight -= len(acked)
        if not self._in_flight:
            self._sent.clear()
            self._sent_pos.clear()
        for msg in self.spool.remove(acked):
            if msg["type"] == "job.exited":
                self._forget(msg["data"]["attempt_id"], msg["seq"])

    def _forget(self, attempt_id: int, seq: int) -> None:
        job = self.jobs.get(attempt_id)
        if job is None or job.exit_seq != seq:
            return
        del self.jobs[attempt_id]
        shutil.rmtree(job.dir, ignore_errors=True)
        if job.outcome is not None:
            self.done[attempt_id] = self._exited_data(job, job.outcome)
            while len(self.done) > DONE_MEMORY:
                del self.done[next(iter(self.done))]
        log.info("attempt %d: exit acked, job directory removed", attempt_id)

    # ------------------------------------------------------------ samples

    def _owner_lookup(self) -> Callable[[int], int | None]:
        by_pgid: dict[int, int] = {}
        by_sid: dict[int, int] = {}
        for job in self.running():
            if job.pgid:
                by_pgid[job.pgid] = job.attempt_id
            if job.shim_pid:
                by_sid[job.shim_pid] = job.attempt_id
        # A terminal's processes are in its own session (its shell's pid).
        by_sid.update(self.terminals.pids())

        def owner(pid: int) -> int | None:
            try:
                attempt = by_pgid.get(os.getpgid(pid))
                return attempt if attempt is not None else by_sid.get(os.getsid(pid))
            except OSError:
                return None

        return owner

    async def sampler(self) -> None:
        interval = self.config.sample_interval_s
        next_at = time.monotonic()
        while True:
            owner = self._owner_lookup()
            gpus = await asyncio.to_thread(self.reader.sample, owner)
            data = p.MetricsData(sampled_at=time.time(), gpus=gpus)
            if self.connected:
                self._send_live(p.Metrics, data)
            else:
                self._spool_sample(data)
            next_at += interval
            now = time.monotonic()
            if next_at < now:  # fell behind: skip, keep the cadence
                next_at = now + interval
            await asyncio.sleep(next_at - now)

    def _spool_sample(self, data: p.MetricsData) -> None:
        """While disconnected: keep one sample every ``spool_metrics_interval_s``."""
        now = time.monotonic()
        if now - self._last_spooled_sample < self.config.spool_metrics_interval_s:
            return
        self._last_spooled_sample = now
        seq, frame = self._frame(p.Metrics, data)
        self.spool.append(seq, frame, droppable=True)
        self._wake.set()

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            ids = [j.attempt_id for j in self.held()]
            self._send_live(p.Heartbeat, p.HeartbeatData(running=ids))

    # ------------------------------------------------------------ supervisor

    async def _supervise(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` forever: a crash is logged and restarted with backoff."""
        failures = 0
        while True:
            try:
                await fn()
                return
            except Exception:
                failures += 1
                log.exception("%s crashed; restarting", name)
                await asyncio.sleep(min(30.0, 0.5 * 2 ** min(failures, 6)))

    async def run(self) -> None:
        """Run until ``shutdown`` is set; never kills jobs."""
        loops: dict[str, Callable[[], Awaitable[None]]] = {
            "link": self.link,
            "reaper": self.reaper,
            "sampler": self.sampler,
            "heartbeat": self.heartbeat,
        }
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._supervise(n, f)) for n, f in loops.items()]
            await self.shutdown.wait()
            log.info("shutting down; jobs keep running")
            for task in tasks:
                task.cancel()
        with contextlib.suppress(Exception):
            self.reader.close()
