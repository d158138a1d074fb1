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
    # Recorded in spec.json, so the shim and a restarted agent agree, and it is
    # the account job.started reports.
    assert json.loads((job.dir / "spec.json").read_text())["run_as"] == "nobody"
    assert job.run_as == "nobody"
    [again] = launcher.scan()
    assert again.run_as == "nobody"


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


# ------------------------------------------- the directory's numbers (launch v2)


def absent_uid() -> int:
    """A uid this machine's user database does not know (a directory user's)."""
    uid = 20001
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


@root_only
def test_a_launch_runs_under_the_numbers_it_carries(tmp_path: Path) -> None:
    """As Slurm with the uid of its job credential: the node need not know the
    account; the supplementary groups are the launch's, HOME the workdir."""
    uid = absent_uid()
    workdir = tmp_path / "work"
    workdir.mkdir(mode=0o777)
    workdir.chmod(0o777)
    launcher = make_launcher(tmp_path, default_account="nobody")
    data = JobLaunchData.model_validate(
        launch_data(
            1,
            'id -u; id -g; id -G; echo "$USER" "$HOME"',
            workdir,
            run_as="dora",
            run_as_uid=uid,
            run_as_gid=uid,
            run_as_gids=[5000, 5001],
        )
    )
    job = launcher.launch(data)
    outcome = wait_until(lambda: launcher.poll(job), 15)
    assert (outcome.reason, outcome.exit_code) == ("exited", 0), outcome
    lines = (job.dir / "output.log").read_text().splitlines()
    assert lines[0] == str(uid)
    assert lines[1] == str(uid)
    assert sorted(lines[2].split()) == sorted([str(uid), "5000", "5001"])
    assert lines[3] == f"dora {workdir}"


@root_only
@pytest.mark.parametrize(
    ("uid", "gid", "gids"), [(0, 20001, []), (20001, 0, []), (20001, 20001, [0])]
)
def test_root_numbers_are_refused(
    tmp_path: Path, uid: int, gid: int, gids: list[int]
) -> None:
    _, outcome = run(
        make_launcher(tmp_path, allow_root_jobs=True),
        "true",
        run_as="dora",
        run_as_uid=uid,
        run_as_gid=gid,
        run_as_gids=gids,
    )
    assert outcome.reason == "launch_failed"
    assert "refusing to run a job as 'dora'" in outcome.message
    assert "root's" in outcome.message


@root_only
def test_the_node_may_require_its_own_user_database_to_agree(
    tmp_path: Path, account: pwd.struct_passwd
) -> None:
    strict = make_launcher(tmp_path / "a", require_local_account=True)
    uid = absent_uid()
    _, outcome = run(strict, "true", run_as="dora", run_as_uid=uid, run_as_gid=uid)
    assert outcome.reason == "launch_failed"
    assert "not in this node's user database" in outcome.message
    assert "--require-local-account" in outcome.message

    name = account.pw_name
    _, outcome = run(
        make_launcher(tmp_path / "b", require_local_account=True),
        "true",
        run_as=name,
        run_as_uid=account.pw_uid + 1,
        run_as_gid=account.pw_gid,
    )
    assert outcome.reason == "launch_failed"
    assert f"uid {account.pw_uid + 1} gid {account.pw_gid} in the directory" in (
        outcome.message
    )
    assert f"uid {account.pw_uid} gid {account.pw_gid} on this node" in (
        outcome.message
    )

    job, outcome = run(
        make_launcher(tmp_path / "c", require_local_account=True),
        "id -u",
        run_as=name,
        run_as_uid=account.pw_uid,
        run_as_gid=account.pw_gid,
    )
    assert (outcome.reason, outcome.exit_code) == ("exited", 0)
    assert (job.dir / "output.log").read_text().split() == [str(account.pw_uid)]


@pytest.mark.parametrize(
    "extra",
    [
        {"run_as_uid": 20001},
        {"run_as_gid": 20001},
        {"run_as_gids": [5000]},
        {"run_as_uid": 2**32 - 1, "run_as_gid": 1},
        {"run_as_uid": -1, "run_as_gid": 1},
    ],
)
def test_a_launch_with_half_an_account_is_refused(extra: dict[str, object]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        JobLaunchData.model_validate(launch_data(1, "true", "/", **extra))


def test_the_agent_flag_and_its_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agents.main import build_parser

    base = ["--server", "ws://h:1"]
    assert build_parser().parse_args(base).require_local_account is False
    flag = [*base, "--require-local-account"]
    assert build_parser().parse_args(flag).require_local_account is True
    monkeypatch.setenv("GPULAB_AGENT_REQUIRE_LOCAL_ACCOUNT", "true")
    assert build_parser().parse_args(base).require_local_account is True
