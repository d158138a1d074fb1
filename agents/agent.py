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
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import os
import random
import shutil
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from agents import protocol as p
from agents.launcher import STOP_CUT_OFF, STOP_TIME_LIMIT, Job, Launcher, Outcome
from agents.spool import SeqCounter, Spool
from agents.statedir import StateDir, atomic_write, read_int

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from agents.nvml import GpuReader

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
LOG_CHUNK_BYTES = 64 * 1024
LINK_STABLE_S = 30.0  # a link up this long resets the backoff
REJECTED_CODES = {4401, 4403}
DONE_MEMORY = 4096  # finished attempts remembered to answer repeated launches


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
    # While disconnected: one metrics frame per this many seconds goes to the spool.
    spool_metrics_interval_s: float = 10.0
    spool_max_bytes: int = 64 * 1024 * 1024
    # Stop every job once the link has been down this long (None: never).
    kill_after_disconnect_s: float | None = None


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, base * 2**attempt))."""
    return random.uniform(0, min(cap, base * 2 ** min(attempt, 32)))


class Agent:
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
        )
        self.spool = Spool(self.state.spool, max_bytes=config.spool_max_bytes)
        self.seq = SeqCounter(self.state.agent_json, floor=self.spool.max_seq)
        self.jobs: dict[int, Job] = {}
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
        self._recover()

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

    def on_kill(self, data: p.JobKillData) -> None:
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
                "attempt %d: kill (%s, grace %d s)",
                data.attempt_id,
                data.reason,
                data.grace_s,
            )
            self.launcher.kill(job, data.grace_s, data.reason)

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

    # ------------------------------------------------------------ reaper

    def _report_started(self, job: Job, *, resend: bool = False) -> None:
        pgid = job.pgid
        assert pgid is not None
        started_at = (job.dir / "pgid").stat().st_mtime
        self._durable(
            p.JobStarted,
            p.JobStartedData(
                attempt_id=job.attempt_id,
                job_id=job.job_id,
                pid=pgid,
                started_at=started_at,
            ),
        )
        if not resend:
            atomic_write(job.dir / "started", f"{started_at}\n")
            if self.sim:
                self.sim.attach(job.attempt_id, job.gpu_uuids, pgid, job.env)
            log.info("attempt %d: started, pid %d", job.attempt_id, pgid)

    @staticmethod
    def _exited_data(job: Job, outcome: Outcome) -> p.JobExitedData:
        return p.JobExitedData(
            attempt_id=job.attempt_id,
            job_id=job.job_id,
            exit_code=outcome.exit_code,
            ended_at=outcome.ended_at,
            reason=outcome.reason,
            message=outcome.message,
        )

    def _report_exit(self, job: Job, outcome: Outcome, *, resend: bool = False) -> None:
        seq = self._durable(p.JobExited, self._exited_data(job, outcome))
        job.exit_seq = seq
        if not resend:
            if self.sim:
                self.sim.detach(job.attempt_id)
            log.info(
                "attempt %d: %s, exit code %s %s",
                job.attempt_id,
                outcome.reason,
                outcome.exit_code,
                outcome.message,
            )

    def _ship_log(self, job: Job, *, final: bool) -> None:
        """Spool new bytes of output.log as job.log chunks (<= 64 KiB each).

        Text is cut at a UTF-8 character boundary (an incremental decoder keeps a
        partial character for the next read), so ``offset`` is always the byte offset
        of a chunk's first character. One chunk per tick while running, the rest at
        the end.
        """
        path = job.dir / "output.log"
        offset = job.log_offset
        if offset is None:
            offset = job.log_offset = read_int(job.dir / "log_offset") or 0
        try:
            if path.stat().st_size <= offset:
                return  # nothing new: spare the open and read
            fh = path.open("rb")
        except FileNotFoundError:
            return
        with fh:
            while True:
                fh.seek(offset)
                raw = fh.read(LOG_CHUNK_BYTES)
                if not raw:
                    return
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                last = final and len(raw) < LOG_CHUNK_BYTES
                text = decoder.decode(raw, final=last)
                used = len(raw) - len(decoder.getstate()[0])
                if used == 0:
                    if len(raw) < 4 and not final:
                        return  # wait for the rest of the character
                    text, used = decoder.decode(b"", final=True), len(raw)
                self._durable(
                    p.JobLog,
                    p.JobLogData(
                        attempt_id=job.attempt_id,
                        job_id=job.job_id,
                        offset=offset,
                        data=text,
                    ),
                )
                self._warn_bad_progress(job, job.progress.feed(text, time.time()))
                offset += used
                atomic_write(job.dir / "log_offset", f"{offset}\n")
                job.log_offset = offset
                if not final:
                    return

    @staticmethod
    def _warn_bad_progress(job: Job, bad_line: str | None) -> None:
        if bad_line is not None:
            log.warning(
                "attempt %d: ignoring %r: a progress line is 'GPULAB_PROGRESS <step>'"
                " or 'GPULAB_PROGRESS <step>/<total>' (further bad ones are ignored"
                " silently)",
                job.attempt_id,
                bad_line,
            )

    def _send_progress(
        self, job: Job, *, final: bool = False, now: float | None = None
    ) -> None:
        """Spool the job's latest progress if it is due (``ProgressTracker.take``).

        Always through the spool, droppable like metric samples: a report is worth
        keeping across a dropped connection, but never at the cost of an exit.
        """
        if final:
            self._warn_bad_progress(job, job.progress.finish(time.time()))
        reading = job.progress.take(
            time.monotonic() if now is None else now, final=final
        )
        if reading is None:
            return
        seq, frame = self._frame(
            p.JobProgress,
            p.JobProgressData(
                attempt_id=job.attempt_id,
                job_id=job.job_id,
                at=reading.at,
                step=reading.step,
                total=reading.total,
            ),
        )
        self.spool.append(seq, frame, droppable=True)
        self._wake.set()

    def _reap(self, job: Job) -> None:
        if job.exit_seq is not None:
            return
        # Poll before looking for ``pgid``: the shim writes ``pgid`` before
        # ``exit_code``, so an exit seen here always finds the start reported first.
        outcome = self.launcher.poll(job)
        if not job.started and job.pgid is not None:
            self._report_started(job)
        if outcome is None:
            # The command writes output.log before the shim has written ``pgid``:
            # no job.log goes out ahead of job.started.
            if job.started:
                self._enforce_time_limit(job)
                self._ship_log(job, final=False)
                self._send_progress(job)
            return
        job.outcome = outcome
        self._ship_log(job, final=True)
        self._send_progress(job, final=True)  # ahead of the exit, so it is not lost
        self._report_exit(job, outcome)

    def _enforce_time_limit(self, job: Job) -> None:
        deadline = job.deadline
        if deadline is None or time.time() < deadline or job.stopping:
            return
        log.info(
            "attempt %d: time limit of %s s reached, stopping it (grace %d s)",
            job.attempt_id,
            job.time_limit_s,
            job.grace_s,
        )
        self.launcher.kill(job, job.grace_s, STOP_TIME_LIMIT)

    def _enforce_cut_off(self) -> None:
        limit = self.config.kill_after_disconnect_s
        if limit is None or self.connected:
            return
        if time.monotonic() - self.down_since < limit:
            return
        for job in self.running():
            if job.stopping:
                continue
            log.warning(
                "attempt %d: cut off from the portal for %g s, stopping it",
                job.attempt_id,
                limit,
            )
            self.launcher.kill(
                job,
                job.grace_s,
                STOP_CUT_OFF,
                f"agent cut off from the portal for {limit:g} s",
            )

    async def reaper(self) -> None:
        while True:
            for job in list(self.jobs.values()):
                try:
                    self._reap(job)
                except OSError as exc:
                    log.warning("attempt %d: reaper: %s", job.attempt_id, exc)
            try:
                self._enforce_cut_off()
            except OSError as exc:
                log.warning("stopping jobs after a cut-off: %s", exc)
            self.launcher.reap_children()
            await asyncio.sleep(self.config.reap_interval_s)

    # ------------------------------------------------------------ live frames

    def running(self) -> list[Job]:
        return [
            j for j in self.jobs.values() if j.outcome is None and j.exit_seq is None
        ]

    def held(self) -> list[Job]:
        """Every attempt this agent holds: running, or ended with its exit not yet
        acknowledged. What hello and heartbeats list, so that the portal's
        reconciler never takes an exit on its way for a vanished job."""
        return list(self.jobs.values())

    def _owner_lookup(self) -> Callable[[int], int | None]:
        by_pgid: dict[int, int] = {}
        by_sid: dict[int, int] = {}
        for job in self.running():
            if job.pgid:
                by_pgid[job.pgid] = job.attempt_id
            if job.shim_pid:
                by_sid[job.shim_pid] = job.attempt_id

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

    # ------------------------------------------------------------ link

    def _hello(self) -> p.HelloData:
        return p.HelloData(
            agent_version=AGENT_VERSION,
            hostname=self.hostname,
            incarnation=self.incarnation,
            driver_version=self.reader.driver_version,
            cuda_version=self.reader.cuda_version,
            gpus=self.reader.gpus(),
            running=[
                p.RunningJob(attempt_id=j.attempt_id, job_id=j.job_id, pid=j.pgid)
                for j in self.held()
            ],
        )

    async def _send(
        self, ws: ClientConnection, seq: int, frame: str, *, durable: bool = False
    ) -> None:
        pos = self._send_count
        self._send_count += 1
        if durable:
            self._in_flight += 1
        if self._in_flight:  # an ack for this frame may cover durable ones
            self._sent_pos[seq] = pos
            self._sent.append((pos, seq, durable))
        await ws.send(frame)

    async def _sender(self, ws: ClientConnection) -> None:
        seq, frame = self._frame(p.Hello, self._hello())
        await self._send(ws, seq, frame)
        last = 0
        while True:
            self._wake.clear()
            durable = self.spool.pending(after=last)
            live, self._live = self._live, []
            batch = sorted(
                [(s, f, True) for s, f in durable] + [(s, f, False) for s, f in live]
            )
            for seq, frame, is_durable in batch:
                await self._send(ws, seq, frame, durable=is_durable)
                if is_durable:
                    last = seq
            await self._wake.wait()

    async def _receiver(self, ws: ClientConnection) -> None:
        async for raw in ws:
            try:
                msg = p.parse_server_message(raw)
            except p.ProtocolError as exc:
                log.warning("bad frame from the server: %s", exc)
                continue
            if isinstance(msg, p.JobLaunch):
                self.on_launch(msg.data)
            elif isinstance(msg, p.JobKill):
                self.on_kill(msg.data)
            elif isinstance(msg, p.Ack):
                self.on_ack(msg.data.seq)
            elif isinstance(msg, p.NodeDrain):
                log.info("server asked to drain this node")
            elif isinstance(msg, p.Error):
                log.warning("server error %s: %s", msg.data.code, msg.data.detail)

    async def _session(self, ws: ClientConnection) -> None:
        """Send and receive until either side fails or the server closes."""
        self._sent_pos, self._live = {}, []
        self._sent.clear()
        self._in_flight = 0
        self._send_count = 0
        self.connected = True
        tasks = [
            asyncio.create_task(self._sender(ws)),
            asyncio.create_task(self._receiver(ws)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise what ended the session
        finally:
            self.connected = False
            self.down_since = self._last_spooled_sample = time.monotonic()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def link(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.token}"}
        attempt = 0
        while True:
            up_since: float | None = None
            try:
                async with connect(
                    self.config.server,
                    additional_headers=headers,
                    open_timeout=10,
                    close_timeout=1,
                    max_size=p.MAX_FRAME_BYTES,
                    compression=p.WS_COMPRESSION,
                ) as ws:
                    up_since = time.monotonic()
                    log.info("connected to %s", self.config.server)
                    try:
                        await self._session(ws)
                    except asyncio.CancelledError:
                        # Shutdown: say goodbye with 1000, not 1011 (the default
                        # when the context manager exits on an exception).
                        with contextlib.suppress(Exception):
                            await ws.close()
                        raise
                code = ws.close_code
                if code in REJECTED_CODES:
                    log.error(
                        "server rejected the token (close code %s); retrying", code
                    )
                else:
                    log.warning("server closed the connection (code %s)", code)
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    log.error(
                        "server rejected the token (HTTP %s); check --token-file;"
                        " retrying",
                        status,
                    )
                else:
                    log.warning("server refused the websocket: HTTP %s", status)
            except (OSError, TimeoutError, WebSocketException) as exc:
                if (
                    isinstance(exc, ConnectionClosed)
                    and exc.rcvd
                    and exc.rcvd.code in REJECTED_CODES
                ):
                    log.error(
                        "server rejected the token (close code %s); retrying",
                        exc.rcvd.code,
                    )
                else:
                    log.warning("link to %s down: %r", self.config.server, exc)
            if up_since is not None and time.monotonic() - up_since >= LINK_STABLE_S:
                attempt = 0
            delay = backoff_delay(
                attempt, self.config.backoff_base_s, self.config.backoff_cap_s
            )
            attempt += 1
            log.info("reconnecting in %.1f s", delay)
            await asyncio.sleep(delay)

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
