"""The agent's side of its jobs' directories: each tick it reports a job's start,
ships new output as ``job.log`` chunks, spools progress readings, stops a job at
its time limit (or every job after a long cut-off), and reports each exit."""

from __future__ import annotations

import asyncio
import codecs
import logging
import time

from agents import jupyter
from agents import protocol as p
from agents.core import AgentCore
from agents.launcher import STOP_CUT_OFF, STOP_TIME_LIMIT, Job, Outcome
from agents.statedir import atomic_write, read_int

log = logging.getLogger(__name__)

LOG_CHUNK_BYTES = 64 * 1024


class Reaper(AgentCore):
    """The job-directory half of ``Agent``: the ``reaper`` loop."""

    def _report_started(self, job: Job, *, resend: bool = False) -> None:
        pgid = job.pgid
        assert pgid is not None
        started_at = (job.dir / "pgid").stat().st_mtime
        server = jupyter.recorded(job.dir)
        self._durable(
            p.JobStarted,
            p.JobStartedData(
                attempt_id=job.attempt_id,
                job_id=job.job_id,
                pid=pgid,
                started_at=started_at,
                interactive_host=server.host if server else "",
                interactive_port=server.port if server else None,
                interactive_command=server.command[:1024] if server else "",
                run_as=job.run_as[:256],
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
                self._check_server(job)
                self._enforce_time_limit(job)
                self._ship_log(job, final=False)
                self._send_progress(job)
            return
        job.outcome = outcome
        self.terminals.end_attempt(job.attempt_id, "the job ended")
        self._ship_log(job, final=True)
        self._send_progress(job, final=True)  # ahead of the exit, so it is not lost
        self._report_exit(job, outcome)

    @staticmethod
    def _check_server(job: Job) -> None:
        """An interactive job's server: note when its port first answers (an
        exit before that is a launch failure, ``jupyter.early_exit``)."""
        if job.interactive_ready:
            return
        server = jupyter.recorded(job.dir)
        job.interactive_ready = server is None or jupyter.check_ready(job.dir, server)
        if job.interactive_ready and server is not None:
            log.info(
                "attempt %d: JupyterLab listening on %s:%d",
                job.attempt_id,
                server.host,
                server.port,
            )

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
            self.terminals.sweep()
            await asyncio.sleep(self.config.reap_interval_s)
