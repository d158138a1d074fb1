"""The agent's state directory: paths, atomic writes, process identity.

Layout (``--state-dir``, default ``$GPULAB_STATE_DIR/agent`` or ``/var/lib/gpulab-agent``)::

    agent.json              {"seq_lease": N}: seqs below N may have been used
    spool.jsonl             unacked durable frames, one JSON envelope a line (job
                            lifecycle, logs, and metrics sampled while disconnected)
    spool.jsonl.acked       seqs acked since spool.jsonl was last compacted
    jobs/<attempt_id>/      one directory per launched attempt (the registry)
        spec.json           the job.launch data, written before the shim starts
                            (run_as filled in from --default-account; time_limit_s)
        shim.pid            "<pid> <start time from /proc/<pid>/stat>"
        pgid                process group of the user's command
        started             started_at of job.started (wall clock), once spooled;
                            with time_limit_s it gives the deadline after a restart
        log_offset          bytes of output.log already spooled as job.log
        output.log          the command's stdout and stderr
        stop                "<grace_s> <reason> [message]", written by the agent to
                            kill (reason time_limit / cut_off: the agent's own)
        exit_code           written last by the shim, atomically
        launch_error        why the shim could not start the command
        port_busy           rank 0 of a job spanning nodes was not started: its
                            rendezvous port is in use here (the message says so)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DEFAULT_STATE_DIR = Path("/var/lib/gpulab-agent")


def default_state_dir() -> Path:
    """``$GPULAB_STATE_DIR/agent`` when that variable is set, else /var/lib/..."""
    base = os.environ.get("GPULAB_STATE_DIR")
    return Path(base) / "agent" if base else DEFAULT_STATE_DIR


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: write a tmp file, fsync, rename, fsync dir."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_text(path: Path) -> str | None:
    """The file's text, or None if it does not exist or cannot be read."""
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), None if no such pid.

    Together with the pid it names one process for its whole life: a pid reused
    by another process has a different start time.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces.
    rest = stat[stat.rfind(")") + 2 :].split()
    return rest[19] if len(rest) > 19 else None


def process_alive(pid: int, start_time: str | None) -> bool:
    """True if ``pid`` runs and is the same process (same start time), not a zombie."""
    current = proc_start_time(pid)
    if current is None or (start_time is not None and current != start_time):
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text()
        if state[state.rfind(")") + 2 :].startswith("Z"):
            return False
    return True


class StateDir:
    """Paths inside one agent state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs = root / "jobs"
        self.agent_json = root / "agent.json"
        self.spool = root / "spool.jsonl"

    def ensure(self) -> None:
        self.jobs.mkdir(parents=True, exist_ok=True, mode=0o700)

    def job_dir(self, attempt_id: int) -> Path:
        return self.jobs / str(attempt_id)
