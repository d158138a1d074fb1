"""Helpers of the fault tests on real processes: beat, more workers, fast
liveness settings, and the processes of jobs on simulated nodes."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from tests.e2e.conftest import Proc, Stack, live_processes_in_group

if TYPE_CHECKING:
    from pathlib import Path

    import pytest


def set_fast_liveness(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    """Environment for the processes the ``stack`` fixture starts next: beat's
    backstops every second, a short reconciler grace, passes every 2 s."""
    env = {
        "GPULAB_CHECK_NODES_INTERVAL": "1",
        "GPULAB_RECONCILE_INTERVAL": "1",
        "GPULAB_RECONCILE_GRACE": "3",
        "GPULAB_SCHEDULE_INTERVAL": "2",
        **extra,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def start_beat(s: Stack, name: str = "beat") -> Proc:
    """Celery beat with a schedule file of its own (two beats never share one)."""
    proc = s.start(
        name,
        sys.executable, "-m", "celery", "-A", "portal", "beat",
        "--loglevel", "INFO", "--schedule", str(s.tmp / f"{name}-schedule"),
    )  # fmt: skip
    proc.wait_for(r"beat: Starting")
    return proc


def start_worker(s: Stack, name: str) -> Proc:
    """Another Celery worker on the default queue (like the stack's own)."""
    proc = s.start(
        name,
        sys.executable, "-m", "celery", "-A", "portal", "worker",
        "--loglevel", "INFO", "--concurrency", "1", "--pool", "solo",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "--hostname", f"{name}@%h",
    )  # fmt: skip
    proc.wait_for(r"\bready\.")
    return proc


def job_pgid(s: Stack, node: str, attempt_id: int) -> int:
    """The process group of an attempt's command on a simulated node (read while
    it runs: the agent removes the job's directory once its exit is acked)."""
    path = s.tmp / f"agent-{node}" / "jobs" / str(attempt_id) / "pgid"
    return int(path.read_text().split()[0])


def alive(pgid: int) -> bool:
    return bool(live_processes_in_group(pgid))


def waiting_command(marker: Path, runs: Path) -> str:
    """A job that records each run (its attempt id) then waits for ``marker``."""
    return (
        f'echo "$GPULAB_ATTEMPT_ID" >> {runs}; echo started;'
        f" while [ ! -e {marker} ]; do sleep 0.1; done; echo done"
    )
