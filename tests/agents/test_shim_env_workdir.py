"""The agent runs a job with exactly the environment and directory it was given:
an environment name ``/bin/sh`` would silently drop is a launch failure naming it
(a spec stored before the portal refused such names), every value the shell keeps
arrives as given, and the job runs in the lexically normalised working
directory, the one the portal shows, whatever symlinks a ``..`` would climb."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from agent_helpers import launch_data, wait_until

from agents.launcher import Launcher, Outcome
from agents.protocol import JobLaunchData
from agents.statedir import StateDir

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture
def launcher(tmp_path: Path) -> Launcher:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return Launcher(state, allow_root_jobs=True)


def run(launcher: Launcher, job_id: int, command: str, workdir: str | Path,
        **extra: object) -> tuple[Outcome, Path]:  # fmt: skip
    data = JobLaunchData.model_validate(launch_data(job_id, command, workdir, **extra))
    job = launcher.launch(data)
    return wait_until(lambda: launcher.poll(job), 15), job.dir


@pytest.mark.parametrize("name", ["FOO\n", "FO O", "1FOO"])
def test_an_env_name_the_shell_would_drop_fails_the_launch(
    launcher: Launcher, tmp_path: Path, name: str
) -> None:
    outcome, _ = run(launcher, 1, "echo ran", tmp_path, env={name: "1"})

    assert outcome.reason == "launch_failed"
    assert repr(name) in outcome.message
    assert "not a shell name" in outcome.message


def test_the_shim_itself_refuses_such_a_name(tmp_path: Path) -> None:
    # The launcher checks first; the shim checks the spec it reads too.
    data = JobLaunchData.model_validate(
        launch_data(2, "echo ran", tmp_path, env={"FOO\n": "1"})
    )
    job_dir = tmp_path / "state" / "jobs" / "2"
    job_dir.mkdir(parents=True)
    (job_dir / "spec.json").write_text(data.model_dump_json())

    subprocess.run([sys.executable, "-m", "agents.shim", str(job_dir)], check=True)

    assert "'FOO\\n'" in (job_dir / "launch_error").read_text()
    assert not (job_dir / "exit_code").exists()


def test_values_arrive_exactly(launcher: Launcher, tmp_path: Path) -> None:
    env = {"MULTI": "one\ntwo\r\n", "TAB": "a\tb", "BIDI": "x\u202ey", "EQ": "k=v"}
    command = 'printf "%s|" "$MULTI" "$TAB" "$BIDI" "$EQ"'

    outcome, job_dir = run(launcher, 3, command, tmp_path, env=env)

    assert (outcome.reason, outcome.exit_code) == ("exited", 0)
    got = (job_dir / "output.log").read_bytes().decode()
    assert got == "|".join(env.values()) + "|"


def test_the_job_runs_in_the_normalised_workdir(
    launcher: Launcher, tmp_path: Path
) -> None:
    # link -> deep/er: the kernel would resolve link/.. to deep, not tmp_path.
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "target").mkdir()
    (tmp_path / "deep" / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "er")

    outcome, job_dir = run(launcher, 4, "pwd -P", f"{tmp_path}/link/../target/.")

    assert outcome.reason == "exited", outcome.message
    assert (job_dir / "output.log").read_text() == f"{tmp_path / 'target'}\n"
