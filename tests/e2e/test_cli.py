"""The ``gpulab`` command line, installed as users get it (the console script,
run as a subprocess with its own config directory and no Django settings),
against the real stack: uvicorn, a Celery worker, a simulated agent whose jobs
are real processes, PostgreSQL and Redis.

Jobs wait on gate files that the test creates, so every "while it runs"
observation is made while the job is certainly running: no sleeps, no timed
assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.e2e.conftest import (
    Stack,
    hold_a_call,
    new_bearer,
    wait_for_job,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GPULAB = str(Path(sys.executable).parent / "gpulab")


@dataclass
class Shell:
    """A login node's shell: ``gpulab`` with nothing but its config dir."""

    env: dict[str, str]
    cwd: Path

    def run(
        self, *args: str, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [GPULAB, *args],
            env=self.env,
            cwd=self.cwd,
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def ok(self, *args: str, input: str | None = None) -> str:
        done = self.run(*args, input=input)
        assert done.returncode == 0, (args, done.returncode, done.stderr)
        return done.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "--json"))


@pytest.fixture
def shell(stack: Stack, alice: User, tmp_path: Path) -> Shell:
    """``gpulab login`` done with a token alice created, as the README says."""
    from portal.api import tokens

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO", "DATABASE", "REDIS", "GPULAB"))
    }
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    # A terminal as wide as a laptop's: without one (no tty) rich wraps at 80,
    # whatever the process running the tests had.
    env["COLUMNS"] = "160"
    work = tmp_path / "work"
    work.mkdir()
    sh = Shell(env, work)
    _token, secret = tokens.create_token(alice, "laptop", 30)
    out = sh.ok("--server", stack.base_url, "login", input=secret + "\n")
    assert f"Logged in to {stack.base_url} as alice (token 'laptop'" in out
    config = tmp_path / "config" / "gpulab" / "config.json"
    assert oct(config.stat().st_mode & 0o777) == "0o600"
    return sh


def gated(gates: Path, label: str) -> str:
    """A command that says it started, waits for its gate file, says done."""
    gate = f"{gates}/{label}"
    return (
        f'echo "{label} starts"; while [ ! -e "{gate}" ]; do sleep 0.05; done;'
        f' echo "{label} done"'
    )


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at a tie)."""
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = most = 0
    for _, step in points:
        running += step
        most = max(most, running)
    return most


def test_an_array_of_five_runs_two_at_a_time_from_the_cli(
    stack: Stack, shell: Shell, tmp_path: Path
) -> None:
    from scheduler.models import Attempt

    stack.start_node("cli-node", "4xA100-80GB", 4)
    gates = tmp_path / "gates"
    gates.mkdir()
    command = gated(gates, "task-$GPULAB_ARRAY_INDEX-of-a$GPULAB_ARRAY_ID")
    # one argument: the node's shell expands the variables
    array_ref = shell.ok(
        "submit", "--array", "0-4%2", "--time", "10m", "-q", "--", command
    ).strip()
    assert array_ref.startswith("a")
    array = shell.json("show", array_ref)
    assert (array["size"], array["max_running"]) == (5, 2)
    tasks = [t["id"] for t in sorted(array["tasks"], key=lambda t: t["index"])]

    # Four GPUs are free, yet two tasks run (the lowest indexes: same priority,
    # then submit order) and three wait for the array's limit.
    for job_id in tasks[:2]:
        assert wait_for_job(job_id, {"running"}) == "running"
    listed = shell.json("ls", "--array", array_ref)
    assert [(j["id"], j["state"], j["reason"]) for j in listed] == [
        (tasks[0], "running", ""),
        (tasks[1], "running", ""),
        *[(t, "pending", "array_limit") for t in tasks[2:]],
    ]
    table = shell.ok("ls").splitlines()
    assert [line.split()[1] for line in table[1:]] == [
        f"{array_ref}[{i}]" for i in range(5)
    ]
    top = shell.ok("top", "--once")
    assert "1 node, 2/4 GPUs in use, 2 running, 3 pending" in top
    assert sum(f"alice:{t}" in top for t in tasks) == 2

    # Open every gate: the rest run as fast as the scheduler lets them.
    for i in range(5):
        (gates / f"task-{i}-of-{array_ref}").touch()
    for job_id in tasks:
        assert wait_for_job(job_id, {"completed", "failed", "cancelled"}) == (
            "completed"
        )

    # Afterwards, from the agent-reported start and end of every attempt.
    attempts = list(Attempt.objects.filter(job_id__in=tasks))
    assert sorted(a.job_id for a in attempts) == sorted(tasks)  # each ran once
    spans = [(a.started_at.timestamp(), a.ended_at.timestamp()) for a in attempts]
    assert max_overlap(spans) == 2

    listed = shell.json("ls", "-a", "--array", array_ref)
    assert [(j["state"], j["exit_code"]) for j in listed] == [("completed", 0)] * 5
    for i, job_id in enumerate(tasks):
        assert shell.ok("logs", str(job_id)) == (
            f"task-{i}-of-{array_ref} starts\ntask-{i}-of-{array_ref} done\n"
        )


def test_logs_follow_a_running_job_to_its_end_and_an_array_is_cancelled(
    stack: Stack, shell: Shell, tmp_path: Path
) -> None:
    from scheduler.models import Job

    stack.start_node("cli-node", "2xA100-80GB", 2)
    gates = tmp_path / "gates"
    gates.mkdir()
    job_id = int(shell.ok("submit", "-q", "--", gated(gates, "follow")).strip())
    # follow it from before it starts: the output comes as the job writes it
    follower = stack.start(
        "logs-f",
        GPULAB,
        "logs",
        "-f",
        str(job_id),
        extra_env={"XDG_CONFIG_HOME": shell.env["XDG_CONFIG_HOME"]},
    )
    follower.wait_for(r"^follow starts$")
    assert Job.objects.get(pk=job_id).status == "running"
    (gates / "follow").touch()
    assert follower.popen.wait(timeout=120) == 0  # it ends when the job does
    assert follower.lines == ["follow starts", "follow done"]
    assert shell.json("show", str(job_id))["state"] == "completed"

    # An array of four, one at a time: cancelling it stops the running task and
    # ends the waiting ones.
    ref = shell.ok(
        "submit", "--array", "0-3%1", "-q", "--", gated(gates, "never")
    ).strip()
    tasks = [t["id"] for t in shell.json("show", ref)["tasks"]]
    assert wait_for_job(tasks[0], {"running"}) == "running"
    out = shell.ok("cancel", ref)
    assert out == f"Array {ref}: cancelled 4 task(s) ({', '.join(map(str, tasks))})\n"
    for task in tasks:
        assert wait_for_job(task, set(Job.TERMINAL)) == "cancelled"
    listed = shell.json("ls", "-a", "--array", ref)
    assert [j["state"] for j in listed] == ["cancelled"] * 4
    again = shell.run("cancel", str(tasks[0]))
    assert again.returncode == 1
    assert "has already ended" in again.stderr
    gone = shell.run("logs", "-f", "999999")
    assert (gone.returncode, gone.stderr.strip()) == (
        4,
        "gpulab: No job 999999 visible to you.",
    )


# One API call at a time and none waiting: a second is refused with 503 "busy"
@pytest.mark.web_env(GPULAB_WEB_API_CONCURRENCY=1, GPULAB_WEB_QUEUE=0)
@pytest.mark.web_only
def test_a_server_too_busy_is_waited_out(
    stack: Stack, shell: Shell, alice: User
) -> None:
    import httpx

    me = f"{stack.base_url}/api/v1/me/"
    held = hold_a_call(me, alice, "holder")  # the one slot
    probe = new_bearer(alice, "probe")
    assert httpx.get(me, headers=probe).status_code == 503  # the API lane is full

    cli = subprocess.Popen(
        [GPULAB, "queue"],
        env=shell.env,
        cwd=shell.cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert cli.stderr is not None
    said = cli.stderr.readline()
    assert said == f"gpulab: {stack.base_url} is too busy; retrying in 1 s\n"
    held.release()  # the held call ends and gives up the slot: the retry gets in
    out, err = cli.communicate(timeout=60)

    assert cli.returncode == 0, err
    assert out.split()[:2] == ["JOBID", "ARRAY"]
