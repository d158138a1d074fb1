"""The shim starts a kill with the signal the kill names (a checkpointable job's
checkpoint signal), then SIGKILLs the group after the grace."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import pytest
from agent_helpers import launch_data, wait_until

from agents import protocol
from agents.launcher import Job, Launcher
from agents.protocol import JobLaunchData
from agents.statedir import StateDir

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture
def launcher(tmp_path: Path) -> Launcher:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return Launcher(state, allow_root_jobs=True)


def start(launcher: Launcher, command: str, workdir: Path) -> Job:
    return launcher.launch(
        JobLaunchData.model_validate(launch_data(1, command, workdir))
    )


def trapping(marker: Path) -> str:
    """Traps USR1 (writes the marker, exits 7); SIGTERM would kill it (143)."""
    return (
        f"trap 'echo usr1 > {marker}; exit 7' USR1; touch {marker}.ready; "
        "while :; do sleep 0.1; done"
    )


def test_the_kill_sends_the_named_signal_first(
    launcher: Launcher, tmp_path: Path
) -> None:
    marker = tmp_path / "m"
    job = start(launcher, trapping(marker), tmp_path)
    wait_until(lambda: job.pgid and (tmp_path / "m.ready").exists())
    launcher.kill(job, 30, "preempted", sig="USR1")
    outcome = wait_until(lambda: launcher.poll(job), 15)
    assert outcome.exit_code == 7  # its trap ran: it exited by itself
    assert marker.read_text() == "usr1\n"
    assert (job.dir / "stop_signal").read_text() == "USR1\n"


def test_a_checkpoint_signal_of_int_reaches_the_jobs_trap(
    launcher: Launcher, tmp_path: Path
) -> None:
    """The shim ignores SIGINT and SIGHUP itself; the job must not inherit that
    (a shell cannot trap a signal ignored at its start)."""
    marker = tmp_path / "m"
    job = start(
        launcher,
        f"trap 'echo int > {marker}; exit 7' INT; touch {marker}.ready; "
        "while :; do sleep 0.1; done",
        tmp_path,
    )
    wait_until(lambda: job.pgid and (tmp_path / "m.ready").exists())
    launcher.kill(job, 30, "preempted", sig="INT")
    outcome = wait_until(lambda: launcher.poll(job), 15)
    assert outcome.exit_code == 7
    assert marker.read_text() == "int\n"


def test_without_a_signal_the_kill_is_sigterm(
    launcher: Launcher, tmp_path: Path
) -> None:
    marker = tmp_path / "m"
    job = start(launcher, trapping(marker), tmp_path)
    wait_until(lambda: job.pgid and (tmp_path / "m.ready").exists())
    launcher.kill(job, 30, "cancelled")
    outcome = wait_until(lambda: launcher.poll(job), 15)
    assert outcome.exit_code == 128 + signal.SIGTERM
    assert not marker.exists()  # its trap never ran


def test_a_job_that_ignores_its_signal_is_killed_after_the_grace(
    launcher: Launcher, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    job = start(
        launcher, f"trap '' USR2; touch {ready}; while :; do sleep 0.1; done", tmp_path
    )
    wait_until(lambda: job.pgid and ready.exists())
    launcher.kill(job, 1, "preempted", sig="USR2")
    outcome = wait_until(lambda: launcher.poll(job), 15)
    assert outcome.exit_code == 128 + signal.SIGKILL


def test_the_kill_frame_names_a_signal_term_by_default() -> None:
    base = {"attempt_id": 1, "job_id": 2, "reason": "preempted", "grace_s": 60}
    assert protocol.JobKillData.model_validate(base).signal == "TERM"
    assert (
        protocol.JobKillData.model_validate({**base, "signal": "USR1"}).signal == "USR1"
    )
    with pytest.raises(ValueError, match="signal"):
        protocol.JobKillData.model_validate({**base, "signal": "KILL"})
