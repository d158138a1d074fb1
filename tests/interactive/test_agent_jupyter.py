"""The agent's side of an interactive job (agents.jupyter): a real JupyterLab
started by the launcher as the job's non-root account in its workdir, with its
GPUs, the token only in its environment; every way it fails to start ends as
``launch_failed`` with the reason."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from agents import jupyter
from agents.launcher import Job, Launcher, Outcome
from agents.protocol import JobLaunchData
from agents.statedir import StateDir
from tests.e2e.conftest import wait_until
from tests.interactive.accounts import root_only

if TYPE_CHECKING:
    import pwd
    from collections.abc import Callable

TOKEN = "tok-" + "s3cr3t" * 6
BASE = "/interactive/7/"
VENV_PATH = f"{Path(sys.executable).parent}:/usr/bin:/bin"

pytestmark = root_only


def wait_for(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    return wait_until(check, timeout)


def launcher(tmp_path: Path) -> Launcher:
    state = StateDir(tmp_path / "state")
    state.ensure()
    # As the e2e agents run: root, allowed to run root jobs (JupyterLab never is).
    return Launcher(state, allow_root_jobs=True)


def launch(tmp_path: Path, workdir: Path, **extra: Any) -> tuple[Launcher, Job]:
    data: dict[str, Any] = {
        "attempt_id": 3,
        "attempt": 1,
        "job_id": 7,
        "name": "JupyterLab",
        "command": "jupyter lab",
        "workdir": str(workdir),
        "env": {"PATH": VENV_PATH},
        "gpu_uuids": ["GPU-aaaa", "GPU-bbbb"],
        "grace_s": 5,
        "interactive": "jupyter",
        "interactive_token": TOKEN,
        "interactive_base_url": BASE,
        **extra,
    }
    ln = launcher(tmp_path)
    return ln, ln.launch(JobLaunchData.model_validate(data))


def outcome_of(ln: Launcher, job: Job, timeout: float = 60.0) -> Outcome:
    return wait_for(lambda: ln.poll(job), timeout)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULAB_JUPYTER_HOST", "127.0.0.1")
    monkeypatch.delenv("GPULAB_JUPYTER_COMMAND", raising=False)


def _group_processes(pgid: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.getpgid(int(proc.name)) == pgid:
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_jupyterlab_runs_as_the_account_with_its_gpus_and_a_hidden_token(
    tmp_path: Path, account: pwd.struct_passwd, workdir: Path
) -> None:
    ln, job = launch(tmp_path, workdir, run_as=account.pw_name)
    server = jupyter.recorded(job.dir)
    assert server is not None and server.host == "127.0.0.1"
    assert server.command.startswith(f"{Path(sys.executable).parent}/jupyter lab ")
    assert f"--ServerApp.base_url={BASE}" in server.command
    assert TOKEN not in server.command and "--allow-root" not in server.command
    try:
        wait_for(lambda: jupyter.check_ready(job.dir, server) or ln.poll(job))
        assert ln.poll(job) is None, (job.dir / "output.log").read_text()
        url = f"http://127.0.0.1:{server.port}{BASE}api/status"
        assert httpx.get(url, headers={"Authorization": f"token {TOKEN}"}).is_success
        assert httpx.get(url).status_code == 403
        assert (
            httpx.get(url, headers={"Authorization": "token wrong"}).status_code == 403
        )

        pgid = job.pgid
        assert pgid is not None
        checked = set()
        for pid in _group_processes(pgid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cwd = Path(f"/proc/{pid}/cwd").readlink()
            except (FileNotFoundError, ProcessLookupError):
                # a short-lived helper of JupyterLab's, gone meanwhile (a process
                # that exits between two reads answers ESRCH, not ENOENT)
                continue
            uid_line = next(ln for ln in status.splitlines() if ln.startswith("Uid:"))
            assert uid_line.split()[1:] == [str(account.pw_uid)] * 4
            assert TOKEN.encode() not in cmdline
            assert b"CUDA_VISIBLE_DEVICES=GPU-aaaa,GPU-bbbb" in environ
            assert cwd == workdir
            checked.add(pid)
        assert pgid in checked  # the server itself (the group's leader) at least
    finally:
        ln.kill(job, 5, "cancelled")
        outcome = outcome_of(ln, job)
    assert outcome.reason == "killed"
    assert TOKEN not in (job.dir / "output.log").read_text()


def test_root_never_runs_jupyterlab(tmp_path: Path, workdir: Path) -> None:
    ln, job = launch(tmp_path, workdir)  # no run_as: the agent's own account, root
    outcome = outcome_of(ln, job)
    assert outcome.reason == "launch_failed"
    assert "never run as root" in outcome.message
    assert job.pgid is None


def test_no_jupyter_on_the_path_and_no_fallback(
    tmp_path: Path, account: pwd.struct_passwd, workdir: Path
) -> None:
    ln, job = launch(
        tmp_path, workdir, run_as=account.pw_name, env={"PATH": "/nonexistent"}
    )
    outcome = outcome_of(ln, job)
    assert outcome.reason == "launch_failed"
    assert "no jupyter on the job's PATH (/nonexistent)" in outcome.message
    assert "GPULAB_JUPYTER_COMMAND" in outcome.message


def test_the_fallback_command_runs_and_an_early_exit_is_a_launch_failure(
    tmp_path: Path,
    account: pwd.struct_passwd,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "GPULAB_JUPYTER_COMMAND", "/bin/sh -c 'echo \"cannot start: $1\" >&2; exit 3' x"
    )
    ln, job = launch(
        tmp_path, workdir, run_as=account.pw_name, env={"PATH": "/nonexistent"}
    )
    outcome = outcome_of(ln, job)
    server = jupyter.recorded(job.dir)
    assert server is not None
    assert (outcome.reason, outcome.exit_code) == ("launch_failed", 3)
    assert outcome.message.startswith(
        f"JupyterLab exited with code 3 before it listened on 127.0.0.1:{server.port}"
    )
    assert "cannot start: lab" in outcome.message


def test_a_port_taken_meanwhile_fails_the_start(
    tmp_path: Path,
    account: pwd.struct_passwd,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(jupyter, "free_port", lambda host: port)
        ln, job = launch(tmp_path, workdir, run_as=account.pw_name)
        outcome = outcome_of(ln, job)
    assert outcome.reason == "launch_failed"
    assert f"before it listened on 127.0.0.1:{port}" in outcome.message
    assert "already in use" in outcome.message
