"""Agent faults on real processes: the agent killed mid-job, a job that ignores
SIGTERM, the portal's web server dying while jobs run."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import (
    Stack,
    csrf_post,
    live_processes_in_group,
    login,
    wait_for_job,
    wait_until,
)
from tests.e2e.test_job_lifecycle import statuses, submit

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def connect_node(stack: Stack, name: str) -> tuple[int, str]:
    from scheduler import services
    from scheduler.models import Node

    node, token = services.create_node(name)
    stack.start_agent(name, token, "2xA100-80GB")
    stack.procs["web"].wait_for(rf"agent of node {name} connected")
    wait_until(
        lambda: Node.objects.filter(pk=node.pk, status="up").exists(),
        what="the node's hello",
    )
    return node.pk, token


def test_a_job_survives_its_agent_being_killed_and_reports_its_true_exit(
    stack: Stack, alice: User
) -> None:
    from scheduler import services
    from scheduler.models import Attempt, Job

    _, token = connect_node(stack, "kill9")
    client = login(stack.base_url, "alice", "pw-alice")
    marker = stack.tmp / "go"
    # The job waits for a file we create after the agent is dead, then exits 7.
    job_id = submit(
        client,
        "survivor",
        f"echo started; while [ ! -e {marker} ]; do sleep 0.1; done; echo done; exit 7",
    )
    assert wait_for_job(job_id, {"running"}) == "running"
    attempt = Attempt.objects.get(job_id=job_id)

    agent = stack.procs["agent-kill9"]
    agent.popen.send_signal(signal.SIGKILL)
    agent.popen.wait(10)
    marker.touch()  # the job ends while no agent watches it
    pgid_file = stack.tmp / "agent-kill9" / "jobs" / str(attempt.pk) / "exit_code"
    wait_until(pgid_file.exists, what="the shim's exit_code file")
    assert Job.objects.get(pk=job_id).status == "running"

    # A new agent on the same state directory finds the job and its exit code.
    restarted = stack.start_agent("kill9", token, "2xA100-80GB")
    restarted.wait_for(r"connected to ws://")

    assert wait_for_job(job_id, set(Job.TERMINAL)) == "failed"
    job = Job.objects.get(pk=job_id)
    assert job.exit_code == 7
    assert statuses(job_id) == ["pending", "starting", "running", "failed"]
    assert Attempt.objects.filter(job_id=job_id).count() == 1  # never run twice
    wait_until(lambda: "done" in services.log_tail(job), what="the rest of the log")
    assert services.log_tail(job).count("started") == 1


def test_a_job_ignoring_sigterm_is_killed_after_its_grace(
    stack: Stack, alice: User
) -> None:
    from scheduler.models import Attempt, Job

    connect_node(stack, "stubborn")
    client = login(stack.base_url, "alice", "pw-alice")
    page = client.get("/jobs/new/")
    assert page.status_code == 200
    resp = csrf_post(
        client,
        "/jobs/new/",
        {
            "name": "stubborn",
            "command": "trap '' TERM; echo ready; while true; do sleep 0.2; done",
            "workdir": "/tmp",
            "gpus": "1",
            "priority_class": "normal",
            "kill_grace": "2s",
        },
    )
    assert resp.status_code == 302, resp.text
    job_id = int(resp.headers["location"].strip("/").split("/")[-1])
    assert wait_for_job(job_id, {"running"}) == "running"
    attempt = Attempt.objects.get(job_id=job_id)
    pgid_file = stack.tmp / "agent-stubborn" / "jobs" / str(attempt.pk) / "pgid"
    pgid = int(wait_until(lambda: pgid_file.exists() and pgid_file.read_text().strip()))

    t0 = time.monotonic()
    assert csrf_post(client, f"/jobs/{job_id}/cancel/", {}).status_code == 302
    assert wait_for_job(job_id, set(Job.TERMINAL)) == "cancelled"
    took = time.monotonic() - t0

    assert live_processes_in_group(pgid) == []
    # SIGTERM was ignored: it took the 2 s grace, then SIGKILL (exit 128 + 9).
    assert took >= 2.0
    assert Job.objects.get(pk=job_id).exit_code == 137
