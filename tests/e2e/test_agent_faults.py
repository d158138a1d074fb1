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
    from scheduler import services
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
    # "ready" is printed after the trap: a SIGTERM before it would end the job (143).
    job = Job.objects.get(pk=job_id)
    wait_until(lambda: "ready" in services.log_tail(job), what="the trap set")

    t0 = time.monotonic()
    assert csrf_post(client, f"/jobs/{job_id}/cancel/", {}).status_code == 302
    assert wait_for_job(job_id, set(Job.TERMINAL)) == "cancelled"
    took = time.monotonic() - t0

    assert live_processes_in_group(pgid) == []
    # SIGTERM was ignored: it took the 2 s grace, then SIGKILL (exit 128 + 9).
    assert took >= 2.0
    assert Job.objects.get(pk=job_id).exit_code == 137


def test_nothing_is_lost_or_doubled_when_the_web_server_dies_mid_job(
    stack: Stack, alice: User
) -> None:
    import json

    from scheduler import services
    from scheduler.models import GpuSample, Job, JobEvent, Node

    node, token = services.create_node("outage")
    agent = stack.start_agent(
        "outage", token, "2xA100-80GB", "--spool-metrics-interval", "1"
    )
    stack.procs["web"].wait_for(r"agent of node outage connected")
    wait_until(lambda: Node.objects.filter(pk=node.pk, status="up").exists())
    client = login(stack.base_url, "alice", "pw-alice")
    marker = stack.tmp / "finish"
    job_id = submit(
        client,
        "through-outage",
        f"echo line-1; while [ ! -e {marker} ]; do sleep 0.1; done; echo line-2",
    )
    assert wait_for_job(job_id, {"running"}) == "running"

    # The portal's web server dies; the job finishes while it is down.
    web = stack.procs.pop("web")
    web.popen.send_signal(signal.SIGKILL)
    web.popen.wait(10)
    agent.wait_for(r"link to .* down")
    marker.touch()
    spool = stack.tmp / "agent-outage" / "spool.jsonl"

    def spooled() -> list[dict[str, object]]:
        frames = []
        for line in spool.read_text().splitlines() if spool.exists() else []:
            frames.append(json.loads(line))
        return frames

    # Wait until the exit and at least three downsampled metric frames are spooled.
    wait_until(
        lambda: (
            any(f["type"] == "job.exited" for f in spooled())
            and sum(f["type"] == "metrics" for f in spooled()) >= 3
        ),
        timeout=60,
        what="the exit and metric samples in the agent's spool",
    )
    # PostgreSQL keeps microseconds: compare at millisecond precision.
    outage_samples = {
        round(f["data"]["sampled_at"], 3) for f in spooled() if f["type"] == "metrics"
    }

    # Back up, persisting every sample it is given (1 s interval).
    stack.start_web("web", GPULAB_METRICS_PERSIST_INTERVAL="1")
    stack.procs["web"].wait_for(r"agent of node outage connected")

    assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"
    job = Job.objects.get(pk=job_id)
    assert job.exit_code == 0
    gpu_ids = list(node.gpus.values_list("pk", flat=True))

    def stored_outage_samples() -> set[float]:
        rows = GpuSample.objects.filter(gpu_id__in=gpu_ids).values_list("at", flat=True)
        return {round(at.timestamp(), 3) for at in rows} & outage_samples

    wait_until(
        lambda: stored_outage_samples() == outage_samples,
        timeout=30,
        what="every sample taken during the outage in the history",
    )
    # Each sample once per GPU (the primary key), each exit once, the log whole.
    per_gpu = GpuSample.objects.filter(gpu_id__in=gpu_ids).values("gpu_id", "at")
    assert len(per_gpu) == len({(r["gpu_id"], r["at"]) for r in per_gpu})
    assert JobEvent.objects.filter(job_id=job_id, to_status="completed").count() == 1
    wait_until(lambda: "line-2" in services.log_tail(job), what="the whole log")
    log = services.log_tail(job)
    assert (log.count("line-1"), log.count("line-2")) == (1, 1)
