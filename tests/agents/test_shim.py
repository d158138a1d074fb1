"""The launcher and the per-job shim, run as real processes."""

from __future__ import annotations

import os
import pwd
import signal
from typing import TYPE_CHECKING

import pytest
from agent_helpers import launch_data, wait_until

from agents.launcher import Job, Launcher, Outcome
from agents.protocol import JobLaunchData
from agents.statedir import StateDir, read_int

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture
def launcher(tmp_path: Path) -> Launcher:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return Launcher(state, allow_root_jobs=True)


def start(launcher: Launcher, command: str, workdir: Path, **extra: object) -> Job:
    data = JobLaunchData.model_validate(launch_data(1, command, workdir, **extra))
    return launcher.launch(data)


def finish(launcher: Launcher, job: Job, timeout: float = 15) -> Outcome:
    return wait_until(lambda: launcher.poll(job), timeout)


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_exit_code_is_recorded(launcher: Launcher, tmp_path: Path) -> None:
    job = start(launcher, "echo out; echo err >&2; exit 3", tmp_path)
    outcome = finish(launcher, job)
    assert (outcome.exit_code, outcome.reason) == (3, "exited")
    assert read_int(job.dir / "exit_code") == 3
    assert (job.dir / "output.log").read_text() == "out\nerr\n"
    assert read_int(job.dir / "pgid")
    assert (job.dir / "shim.pid").read_text().split()[0] == str(job.shim_pid)


def test_sigterm_honoured_gives_143(launcher: Launcher, tmp_path: Path) -> None:
    job = start(launcher, "sleep 1000", tmp_path)
    pgid = wait_until(lambda: job.pgid)
    launcher.kill(job, 5, "cancelled")
    outcome = finish(launcher, job)
    assert (outcome.exit_code, outcome.reason) == (143, "killed")
    assert (job.dir / "stop").read_text().split() == ["5", "cancelled"]
    assert group_gone(pgid)


def test_ignored_sigterm_is_followed_by_sigkill_of_the_whole_group(
    launcher: Launcher, tmp_path: Path
) -> None:
    marker = tmp_path / "trapped"
    job = start(
        launcher,
        f'trap "" TERM; sleep 1000 & sleep 1000 & touch {marker}; wait',
        tmp_path,
    )
    pgid = wait_until(lambda: job.pgid)
    wait_until(marker.exists)
    launcher.kill(job, 1, "timeout")
    # Still there during the grace period ...
    assert not group_gone(pgid)
    outcome = finish(launcher, job)
    assert outcome.exit_code == 128 + signal.SIGKILL
    assert outcome.reason == "killed"
    # ... and the whole group, grandchildren included, is gone afterwards.
    assert group_gone(pgid)


def test_background_processes_do_not_outlive_the_job(
    launcher: Launcher, tmp_path: Path
) -> None:
    job = start(launcher, "sleep 1000 & exit 0", tmp_path)
    pgid = wait_until(lambda: job.pgid)
    assert finish(launcher, job).exit_code == 0
    assert group_gone(pgid)


def test_environment(launcher: Launcher, tmp_path: Path) -> None:
    os.environ["GPULAB_AGENT_TOKEN"] = "secret-token"
    try:
        job = start(
            launcher,
            'echo "cvd=$CUDA_VISIBLE_DEVICES job=$GPULAB_JOB_ID att=$GPULAB_ATTEMPT_ID'
            ' tok=${GPULAB_AGENT_TOKEN:-none} mine=$MINE"',
            tmp_path,
            gpu_uuids=["GPU-a", "GPU-b"],
            env={"MINE": "x y"},
        )
        finish(launcher, job)
    finally:
        del os.environ["GPULAB_AGENT_TOKEN"]
    out = (job.dir / "output.log").read_text()
    assert out == "cvd=GPU-a,GPU-b job=1001 att=1 tok=none mine=x y\n"


def test_only_the_command_reaches_the_shell(launcher: Launcher, tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    evil = f"$(touch {canary}); touch {canary}; `touch {canary}`"
    job = start(
        launcher,
        'printf "%s|" "$EVIL"',
        tmp_path,
        name=evil,
        env={"EVIL": evil},
        gpu_uuids=[f"GPU-1;touch {canary}"],
    )
    assert finish(launcher, job).exit_code == 0
    assert (job.dir / "output.log").read_text() == evil + "|"
    assert not canary.exists()


@pytest.mark.parametrize("kind", ["missing", "file", "relative"])
def test_bad_workdir_is_launch_failed(
    launcher: Launcher, tmp_path: Path, kind: str
) -> None:
    workdir = {
        "missing": tmp_path / "nope",
        "file": tmp_path / "f",
        "relative": "some/dir",
    }[kind]
    (tmp_path / "f").write_text("")
    job = start(launcher, "echo hi", workdir)  # type: ignore[arg-type]
    outcome = finish(launcher, job)
    assert outcome.reason == "launch_failed"
    assert outcome.exit_code is None
    assert "workdir" in outcome.message
    assert "Traceback" not in outcome.message


def test_shim_itself_reports_a_workdir_that_vanished(
    launcher: Launcher, tmp_path: Path
) -> None:
    # The launcher checked the workdir, but it is gone when the shim starts.
    workdir = tmp_path / "w"
    workdir.mkdir()
    launcher.allow_root_jobs = True
    data = JobLaunchData.model_validate(launch_data(2, "true", workdir))
    job_dir = launcher.state.job_dir(2)
    job_dir.mkdir(parents=True)
    (job_dir / "spec.json").write_text(data.model_dump_json())
    workdir.rmdir()
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "agents.shim", str(job_dir)], check=True)
    assert "does not exist" in (job_dir / "launch_error").read_text()
    assert not (job_dir / "exit_code").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_root_agent_refuses_root_jobs_unless_allowed(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "s")
    state.ensure()
    strict = Launcher(state)
    job = start(strict, "true", tmp_path)
    outcome = finish(strict, job)
    assert outcome.reason == "launch_failed"
    assert "refusing to run a job as root" in outcome.message
    assert "--allow-root-jobs" in outcome.message


def test_unknown_account_is_launch_failed(launcher: Launcher, tmp_path: Path) -> None:
    job = start(launcher, "true", tmp_path, run_as="no-such-user-xyz")
    outcome = finish(launcher, job)
    assert outcome.reason == "launch_failed"
    assert "unknown Unix account" in outcome.message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_run_as_switches_account(launcher: Launcher, tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    job = start(launcher, 'id -u; echo "$HOME"', "/", run_as="nobody")
    assert finish(launcher, job).exit_code == 0
    assert (job.dir / "output.log").read_text() == f"{nobody.pw_uid}\n{nobody.pw_dir}\n"


def test_kill_right_after_launch_is_not_lost(
    launcher: Launcher, tmp_path: Path
) -> None:
    job = start(launcher, "sleep 1000", tmp_path)
    launcher.kill(job, 1, "cancelled")  # before the shim is even running Python
    outcome = finish(launcher, job)
    assert outcome.reason == "killed"
    assert outcome.exit_code == 143
