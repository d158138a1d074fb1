"""Start and stop jobs through per-job shims; the job directories are the registry.

Each attempt gets ``<state>/jobs/<attempt_id>/`` (layout in ``statedir``). The agent
talks to a running job only through that directory and signals to its shim, so a
restarted agent rebuilds everything from ``scan()`` (Slurm's ``stepd_available``,
Nomad's ``RecoverTask``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from agents import jupyter
from agents.jobtext import normal_workdir
from agents.progress import ProgressTracker
from agents.protocol import ExitReason, JobLaunchData
from agents.rendezvous import port_busy, rank0_rendezvous
from agents.shim import LaunchError, check_env, check_workdir, resolve_run_as
from agents.statedir import (
    StateDir,
    atomic_write,
    proc_start_time,
    process_alive,
    read_int,
    read_text,
)

log = logging.getLogger(__name__)

# The directory that holds the ``agents`` package: the shim runs from there so that
# ``python -m agents.shim`` imports this very code.
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent

# Reasons the agent itself writes in ``stop`` (besides the server's KillReason): the
# exit is then reported as "timeout" (time limit) or "killed" with the stop message.
STOP_TIME_LIMIT = "time_limit"
STOP_CUT_OFF = "cut_off"
# How often ``poll`` checks that a running job's shim is still alive (a shim that died
# without an exit code is reported ``lost``); exit codes are checked every poll.
ALIVE_CHECK_S = 1.0


@dataclass
class Outcome:
    """How a job ended, ready for ``job.exited``."""

    exit_code: int | None
    reason: ExitReason
    message: str = ""
    ended_at: float = field(default_factory=time.time)


@dataclass
class Job:
    """One attempt known to this agent (running or waiting for its exit to be acked)."""

    attempt_id: int
    job_id: int
    dir: Path
    gpu_uuids: list[str]
    env: dict[str, str]
    time_limit_s: int | None = None
    grace_s: int = 30
    # The Unix account it runs as (reported in job.started).
    run_as: str = ""
    shim_pid: int | None = None
    shim_start: str | None = None
    outcome: Outcome | None = None
    # Set when job.exited has been spooled: only the ack remains.
    exit_seq: int | None = None
    # Caches that spare the reaper file reads on every tick (the files stay the
    # truth after a restart): ``started`` once seen, bytes of output.log spooled,
    # when the shim was last checked alive (monotonic).
    seen_started: bool = field(default=False, repr=False)
    log_offset: int | None = field(default=None, repr=False)
    alive_checked: float = field(default=0.0, repr=False)
    # An interactive job's server answered on its port (or the job has none).
    interactive_ready: bool = field(default=False, repr=False)
    # GPULAB_PROGRESS lines read from the output shipped so far (memory only: after
    # an agent restart the output already shipped is not read again).
    progress: ProgressTracker = field(default_factory=ProgressTracker, repr=False)

    @property
    def pgid(self) -> int | None:
        return read_int(self.dir / "pgid")

    @property
    def started(self) -> bool:
        if not self.seen_started:
            self.seen_started = (self.dir / "started").exists()
        return self.seen_started

    @property
    def started_at(self) -> float | None:
        """The start reported in job.started (wall clock), None before it."""
        text = read_text(self.dir / "started")
        try:
            return float(text.split()[0]) if text else None
        except (ValueError, IndexError):
            return None

    @property
    def deadline(self) -> float | None:
        """Wall-clock time at which the job's time limit is reached, if it has one."""
        if self.time_limit_s is None:
            return None
        started_at = self.started_at
        return None if started_at is None else started_at + self.time_limit_s

    @property
    def stopping(self) -> bool:
        return (self.dir / "stop").exists()


class Launcher:
    """Creates job directories, starts shims, signals them, reads their results."""

    def __init__(
        self,
        state: StateDir,
        *,
        allow_root_jobs: bool = False,
        default_account: str | None = None,
        require_local_account: bool = False,
    ) -> None:
        self.state = state
        self.allow_root_jobs = allow_root_jobs
        # A launch's uid and gid must match the node's own user database.
        self.require_local_account = require_local_account
        # Account for jobs that name no run_as when the agent runs as root.
        self.default_account = default_account
        self._children: list[subprocess.Popen[bytes]] = []

    # ------------------------------------------------------------ launching

    def launch(self, data: JobLaunchData) -> Job:
        """Start ``data`` under a new shim. Never raises for a bad job.

        1. create the job directory and write ``spec.json`` (before anything runs,
           so a crash right after leaves a directory ``scan()`` understands);
        2. check what can be checked here (workdir, account, root); a failure is
           written to ``launch_error`` and reported like any other ending;
        3. rank 0 of a job spanning nodes: check its rendezvous port is free; if
           not, write ``port_busy`` and start nothing (reported as ``port_busy``:
           the portal relaunches the job with another port);
        4. start the shim in its own session and record its pid + start time.
        """
        if (
            data.run_as is None
            and data.run_as_uid is None
            and self.default_account
            and os.geteuid() == 0
        ):
            # Recorded in spec.json: the shim (and a restarted agent) read it there.
            data = data.model_copy(update={"run_as": self.default_account})
        job_dir = self.state.job_dir(data.attempt_id)
        job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(job_dir / "spec.json", data.model_dump_json())
        job = _job_from_spec(data, job_dir)
        try:
            self.preflight(data)
            _check_rendezvous_port(data)
            if data.interactive == "jupyter":
                # The shim runs JupyterLab in place of the command (agents.jupyter).
                data, server = jupyter.prepare(data)
                atomic_write(job_dir / "spec.json", data.model_dump_json())
                jupyter.record(job_dir, server)
            env = dict(os.environ)
            env.pop("GPULAB_AGENT_TOKEN", None)
            shim = subprocess.Popen(
                [sys.executable, "-m", "agents.shim", str(job_dir)],
                cwd=_PACKAGE_PARENT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=(job_dir / "shim.log").open("ab"),
                close_fds=True,
                start_new_session=True,
            )
        except LaunchError as exc:
            atomic_write(job_dir / "launch_error", f"{exc}\n")
            return job
        except _PortBusy as exc:
            atomic_write(job_dir / "port_busy", f"{exc}\n")
            return job
        except OSError as exc:
            atomic_write(job_dir / "launch_error", f"could not start the shim: {exc}\n")
            return job
        job.shim_pid = shim.pid
        job.shim_start = proc_start_time(shim.pid)
        if not (job_dir / "shim.pid").exists():
            atomic_write(job_dir / "shim.pid", f"{shim.pid} {job.shim_start}\n")
        # The shim is in its own session and outlives us; reap it if it ends first
        # so it does not linger as a zombie of the agent.
        self._children.append(shim)
        log.info(
            "attempt %d (job %d): shim pid %d started",
            data.attempt_id,
            data.job_id,
            shim.pid,
        )
        return job

    def preflight(self, data: JobLaunchData) -> None:
        """Raise ``LaunchError`` if ``data`` may not run here (workdir, env,
        account, root): for the job, and for a terminal of it (``agents.terminal``)."""
        check_workdir(normal_workdir(data.workdir), state_root=self.state.root)
        check_env(dict(data.env))
        account = resolve_run_as(
            data.model_dump(), require_local=self.require_local_account
        )
        if os.geteuid() != 0 or self.allow_root_jobs:
            return
        if data.run_as is None and data.run_as_uid is None:
            raise LaunchError(
                "refusing to run a job as root: the job names no run_as account"
                " (start the agent with --default-account USER to run such jobs as"
                " USER, or --allow-root-jobs to permit root)"
            )
        if account is None:  # run_as names an account with uid 0
            raise LaunchError(
                f"refusing to run a job as root: run_as {data.run_as!r} has uid 0"
                " (start the agent with --allow-root-jobs to permit this)"
            )

    # ------------------------------------------------------------ stopping

    def kill(
        self,
        job: Job,
        grace_s: int,
        reason: str,
        message: str = "",
        sig: str = "TERM",
    ) -> None:
        """Write ``stop_signal`` (the signal the shim sends the job's group first,
        by name: a checkpointable job's checkpoint signal) and ``stop`` (grace,
        reason, message), then SIGTERM the shim. The first kill decides both."""
        if not job.stopping:
            atomic_write(job.dir / "stop_signal", f"{sig}\n")
            atomic_write(
                job.dir / "stop", f"{grace_s} {reason} {message}".strip() + "\n"
            )
        # Before ``pgid`` exists the shim may not have its SIGTERM handler yet (the
        # signal would kill it without an exit code); it polls the stop file instead.
        if (
            job.pgid is not None
            and job.shim_pid
            and process_alive(job.shim_pid, job.shim_start)
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.shim_pid, signal.SIGTERM)

    # ------------------------------------------------------------ observing

    def reap_children(self) -> None:
        self._children[:] = [p for p in self._children if p.poll() is None]

    def poll(self, job: Job) -> Outcome | None:
        """How the job ended, or None while it runs."""
        if job.outcome is not None:
            return job.outcome
        # launch_error and port_busy are only ever written before the command starts.
        if not job.seen_started:
            error = read_text(job.dir / "launch_error")
            if error is not None:
                return Outcome(None, "launch_failed", error.strip()[:4000])
            busy = read_text(job.dir / "port_busy")
            if busy is not None:
                return Outcome(None, "port_busy", busy.strip()[:4000])
        code = read_int(job.dir / "exit_code")
        if code is not None:
            return self._ended(job, code)
        now = time.monotonic()
        if job.shim_pid is not None and now - job.alive_checked < ALIVE_CHECK_S:
            return None
        job.alive_checked = now
        if job.shim_pid is None or not process_alive(job.shim_pid, job.shim_start):
            # The shim may have written its result just before exiting.
            code = read_int(job.dir / "exit_code")
            if code is not None:
                return self._ended(job, code)
            if (job.dir / "launch_error").exists() or (job.dir / "port_busy").exists():
                return self.poll(job)
            return Outcome(None, "lost", "the job's shim ended without an exit code")
        return None

    @staticmethod
    def _ended(job: Job, code: int) -> Outcome:
        """The outcome of a command that exited with ``code``: why it stopped."""
        stop = read_text(job.dir / "stop")
        if stop is None:
            early = jupyter.early_exit(job.dir, code)
            if early is not None:
                return Outcome(code, "launch_failed", early)
            return Outcome(code, "exited")
        parts = stop.split()
        reason = parts[1] if len(parts) > 1 else ""
        if reason == STOP_TIME_LIMIT:
            return Outcome(
                code, "timeout", f"time limit of {job.time_limit_s} s reached"
            )
        if reason == STOP_CUT_OFF:
            return Outcome(code, "killed", " ".join(parts[2:]))
        return Outcome(code, "killed")

    def scan(self) -> list[Job]:
        """Rebuild the jobs from their directories (after an agent restart)."""
        jobs: list[Job] = []
        if not self.state.jobs.exists():
            return jobs
        for job_dir in sorted(self.state.jobs.iterdir()):
            if not job_dir.name.isdigit():
                continue
            try:
                spec = JobLaunchData.model_validate_json(
                    (job_dir / "spec.json").read_bytes()
                )
            except (OSError, ValueError) as exc:
                log.warning("ignoring job directory %s: %s", job_dir, exc)
                continue
            job = _job_from_spec(spec, job_dir)
            pid_text = read_text(job_dir / "shim.pid")
            if pid_text:
                parts = pid_text.split()
                with contextlib.suppress(ValueError, IndexError):
                    job.shim_pid = int(parts[0])
                    job.shim_start = parts[1] if len(parts) > 1 else None
            jobs.append(job)
        return jobs

    @staticmethod
    def read_spec(job: Job) -> dict[str, object]:
        data: dict[str, object] = json.loads((job.dir / "spec.json").read_text())
        return data


class _PortBusy(Exception):
    """Rank 0's rendezvous port is taken on this node; the message says so."""


def _check_rendezvous_port(data: JobLaunchData) -> None:
    """Rank 0 of a job spanning nodes: raise ``_PortBusy`` if its port is taken."""
    rendezvous = rank0_rendezvous(data.env)
    if rendezvous is None:
        return
    problem = port_busy(*rendezvous)
    if problem is not None:
        raise _PortBusy(problem)


def _job_from_spec(spec: JobLaunchData, job_dir: Path) -> Job:
    return Job(
        spec.attempt_id,
        spec.job_id,
        job_dir,
        list(spec.gpu_uuids),
        dict(spec.env),
        time_limit_s=spec.time_limit_s,
        grace_s=spec.grace_s,
        run_as=_runs_as(spec),
    )


def _runs_as(spec: JobLaunchData) -> str:
    """The account ``spec`` runs as: its run_as (the agent's --default-account
    already put there), its uid, or this agent's own account."""
    if spec.run_as:
        return spec.run_as
    uid = os.geteuid() if spec.run_as_uid is None else spec.run_as_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
