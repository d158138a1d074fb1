"""The agent with hostile job fields, on real shims and shells.

The command runs under ``/bin/sh -c`` by design: it is the user's own command,
run as the user. Nothing else of the job (name, working directory, environment
names and values) may ever reach a shell, and the agent's own files stay under
``<state>/jobs/<attempt id>/`` whatever the fields say; a working directory inside
the agent's state directory (directly, through ``..`` or a symlink) is refused."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from agents.launcher import Job, Launcher, Outcome
from agents.protocol import JobLaunchData
from agents.statedir import StateDir

if TYPE_CHECKING:
    from pathlib import Path


def launch(launcher: Launcher, attempt_id: int, **fields: Any) -> tuple[Job, Outcome]:
    data = {
        "attempt_id": attempt_id,
        "attempt": 1,
        "job_id": attempt_id + 1000,
        "name": f"job {attempt_id}",
        "command": "true",
        "workdir": "/",
        "env": {},
        "gpu_uuids": [],
        "grace_s": 2,
        **fields,
    }
    job = launcher.launch(JobLaunchData.model_validate(data))
    deadline = time.monotonic() + 20
    while (outcome := launcher.poll(job)) is None:
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.02)
    return job, outcome


@pytest.fixture
def launcher(tmp_path: Path) -> Launcher:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return Launcher(state, allow_root_jobs=True)


def test_no_field_but_the_command_reaches_a_shell(
    launcher: Launcher, tmp_path: Path
) -> None:
    # Relative: run anywhere, they would leave a file in the job's working
    # directory (its cwd) or in the shim's (the job directory).
    inject = "$(touch pwned-1)`touch pwned-2`;touch pwned-3|touch pwned-4"
    workdir = tmp_path / f"w {inject}"
    workdir.mkdir()

    job, outcome = launch(
        launcher,
        1,
        name=f"n {inject}",
        workdir=str(workdir),
        env={"NOTE": f"v {inject}", "GPULAB_SIM_UTIL": f"'{inject}"},
        # Prints what it was given, verbatim.
        command='printf "%s\\n" "$NOTE" "$GPULAB_SIM_UTIL" "$PWD"',
    )

    assert (outcome.reason, outcome.exit_code) == ("exited", 0)
    assert (job.dir / "output.log").read_text().splitlines() == [
        f"v {inject}",
        f"'{inject}",
        str(workdir),
    ]
    leftovers = [p for p in tmp_path.rglob("pwned-*")]
    assert leftovers == []


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"A=B": "x"}, "environment variable name 'A=B' is not a shell name"),
        ({"NOTE": "nul\x00byte"}, "could not start the command"),
    ],
    ids=["name with =", "NUL in a value"],
)
def test_an_environment_no_process_can_have_is_a_launch_failure(
    launcher: Launcher, env: dict[str, str], says: str
) -> None:
    # The portal refuses both; the agent reports them as the job's launch
    # failure, never as a shim that died (which would requeue it forever).
    _, outcome = launch(launcher, 2, env=env)

    assert outcome.reason == "launch_failed"
    assert says in outcome.message


def test_the_job_directory_is_named_by_the_attempt_id_only(
    launcher: Launcher, tmp_path: Path
) -> None:
    job, outcome = launch(
        launcher, 3, name="../../../escaped", command="echo out", workdir=str(tmp_path)
    )

    assert outcome.reason == "exited"
    assert job.dir == tmp_path / "state" / "jobs" / "3"
    assert (job.dir / "output.log").read_text() == "out\n"
    assert not (tmp_path / "escaped").exists()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["jobs"]


def test_a_relative_workdir_is_refused(launcher: Launcher) -> None:
    _, outcome = launch(launcher, 4, workdir="../../etc")

    assert outcome.reason == "launch_failed"
    assert "'../../etc' is not an absolute path" in outcome.message


@pytest.mark.parametrize("how", ["direct", "dot-dot", "symlink"])
def test_a_workdir_inside_the_agents_state_dir_is_refused(
    launcher: Launcher, tmp_path: Path, how: str
) -> None:
    # A job there could rewrite other jobs' exit codes or the spool.
    state = tmp_path / "state"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    workdir = {
        "direct": state / "jobs",
        "dot-dot": outside / ".." / "state",
        "symlink": tmp_path / "link",
    }[how]
    if how == "symlink":
        workdir.symlink_to(state)

    job, outcome = launch(launcher, 5, workdir=str(workdir), command="touch x")

    assert outcome.reason == "launch_failed"
    assert "is inside the agent's state directory" in outcome.message
    assert not (job.dir / "output.log").exists()  # nothing ran
    assert not (state / "jobs" / "x").exists() and not (state / "x").exists()


def test_the_shim_checks_the_workdir_again_at_start(
    launcher: Launcher, tmp_path: Path
) -> None:
    # Swapped for a symlink into the state dir after the agent's own check: the
    # shim, which starts the command, refuses it too.
    workdir = tmp_path / "swapped"
    workdir.mkdir()
    from agents import launcher as launcher_module

    real = launcher_module.check_workdir

    def swap_after_check(path: str, state_root: Path | None = None) -> None:
        real(path, state_root)
        workdir.rmdir()
        workdir.symlink_to(tmp_path / "state")

    launcher_module.check_workdir = swap_after_check  # type: ignore[assignment]
    try:
        _job, outcome = launch(launcher, 6, workdir=str(workdir), command="touch y")
    finally:
        launcher_module.check_workdir = real

    assert outcome.reason == "launch_failed"
    assert "inside the agent's state directory" in outcome.message
    assert not (tmp_path / "state" / "y").exists()
