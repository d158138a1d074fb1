"""Which account a job runs as: run_as, --default-account, never root by accident."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from typing import TYPE_CHECKING

import pytest
from agent_helpers import launch_data, wait_until

from agents.launcher import Job, Launcher, Outcome
from agents.main import main
from agents.protocol import JobLaunchData
from agents.statedir import StateDir

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def make_launcher(tmp_path: Path, **kw: object) -> Launcher:
    state = StateDir(tmp_path / "state")
    state.ensure()
    return Launcher(state, **kw)  # type: ignore[arg-type]


def run(launcher: Launcher, command: str, **extra: object) -> tuple[Job, Outcome]:
    data = JobLaunchData.model_validate(launch_data(1, command, "/", **extra))
    job = launcher.launch(data)
    return job, wait_until(lambda: launcher.poll(job), 15)


@root_only
def test_default_account_runs_jobs_that_name_none(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    launcher = make_launcher(tmp_path, default_account="nobody")
    job, outcome = run(launcher, "id -u; id -g")
    assert (outcome.reason, outcome.exit_code) == ("exited", 0)
    assert (job.dir / "output.log").read_text().split() == [
        str(nobody.pw_uid),
        str(nobody.pw_gid),
    ]
    # Recorded in spec.json, so the shim and a restarted agent agree.
    assert json.loads((job.dir / "spec.json").read_text())["run_as"] == "nobody"


@root_only
def test_unknown_default_account_is_launch_failed(tmp_path: Path) -> None:
    launcher = make_launcher(tmp_path, default_account="no-such-user-xyz")
    _, outcome = run(launcher, "true")
    assert outcome.reason == "launch_failed"
    assert "unknown Unix account 'no-such-user-xyz'" in outcome.message


@root_only
def test_run_as_root_is_refused_unless_allowed(tmp_path: Path) -> None:
    _, outcome = run(make_launcher(tmp_path / "a"), "true", run_as="root")
    assert outcome.reason == "launch_failed"
    assert "refusing to run a job as root" in outcome.message
    _, outcome = run(make_launcher(tmp_path / "b", allow_root_jobs=True), "true")
    assert (outcome.reason, outcome.exit_code) == ("exited", 0)


@pytest.fixture
def account() -> Iterator[pwd.struct_passwd]:
    name = f"gpulabt{os.getpid() % 100000}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", name],
        check=True,
        capture_output=True,
    )
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@root_only
def test_run_as_a_real_account(tmp_path: Path, account: pwd.struct_passwd) -> None:
    launcher = make_launcher(tmp_path, default_account="nobody")
    job, outcome = run(launcher, 'id -u; echo "$USER"', run_as=account.pw_name)
    assert (outcome.reason, outcome.exit_code) == ("exited", 0)
    assert (job.dir / "output.log").read_text().split() == [
        str(account.pw_uid),
        account.pw_name,
    ]


@pytest.mark.parametrize(
    ("name", "expected"), [("no-such-user-xyz", "unknown Unix account"), ("root", "")]
)
def test_cli_checks_the_default_account(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, expected: str
) -> None:
    code = main(
        [
            "--server",
            "ws://h:1",
            "--token-file",
            __file__,
            "--simulate",
            "1xA100-80GB",
            "--state-dir",
            str(tmp_path),
            "--default-account",
            name,
        ]
    )
    assert code == 2
    err = caplog.text
    assert "--default-account" in err
    assert expected in err
