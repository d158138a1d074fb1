"""The whole job lifecycle on real processes: uvicorn (HTTP + websockets), a Celery
worker, a simulated node agent, PostgreSQL and Redis."""

from __future__ import annotations

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
from tests.e2e.conftest import (
    submit as submit_form,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def submit(client, name: str, command: str) -> int:
    page = client.get("/jobs/new/")
    assert page.status_code == 200
    return submit_form(client, name, command)


def statuses(job_id: int) -> list[str]:
    from scheduler.models import JobEvent

    return [
        s
        for s in JobEvent.objects.filter(job_id=job_id)
        .order_by("at", "id")
        .values_list("to_status", flat=True)
        if s
    ]


def test_it_runs_fails_and_cancels_jobs_end_to_end(
    stack: Stack, alice: User, charlie: User
) -> None:
    from scheduler import services
    from scheduler.models import Attempt, Job

    # Arrange: a registered node whose agent connects over the websocket.
    stack.start_node("e2e-node", "2xA100-80GB", 2)
    stack.procs["web"].wait_for(r"agent of node e2e-node connected")
    client = login(stack.base_url, "alice", "pw-alice")

    # 1. A job that succeeds: PENDING -> STARTING -> RUNNING -> COMPLETED. It
    # reports progress on stdout and stderr.
    ok = submit(
        client,
        "hello",
        'echo "hello from $CUDA_VISIBLE_DEVICES"; echo GPULAB_PROGRESS 3/10;'
        " echo GPULAB_PROGRESS 7/10 >&2; echo bye",
    )
    assert wait_for_job(ok, set(Job.TERMINAL)) == "completed"
    job = Job.objects.get(pk=ok)
    assert job.exit_code == 0
    assert statuses(ok) == ["pending", "starting", "running", "completed"]
    attempt = Attempt.objects.get(job=job)
    gpu_uuid = attempt.allocations.first().gpu.uuid
    # The agent sends the last progress ahead of the exit: already stored.
    assert (attempt.progress_step, attempt.progress_total) == (7, 10)
    wait_until(lambda: "bye" in services.log_tail(job), what="the log of the first job")
    assert f"hello from {gpu_uuid}" in services.log_tail(job)
    page = client.get(f"/jobs/{ok}/")
    assert "completed" in page.text
    assert f"hello from {gpu_uuid}" in page.text
    assert "step 7 of 10 (70%)" in page.text

    # 2. A job that fails with exit code 3.
    bad = submit(client, "fails", "echo about to fail >&2; exit 3")
    assert wait_for_job(bad, set(Job.TERMINAL)) == "failed"
    job = Job.objects.get(pk=bad)
    assert job.exit_code == 3
    assert statuses(bad) == ["pending", "starting", "running", "failed"]
    wait_until(lambda: "about to fail" in services.log_tail(job), what="stderr")

    # 3. A job cancelled while running: its whole process group is gone after.
    long = submit(client, "long", "sleep 300 & sleep 300")
    assert wait_for_job(long, {"running"}) == "running"
    attempt = Attempt.objects.get(job_id=long)
    pgid_file = stack.tmp / "agent-e2e-node" / "jobs" / str(attempt.pk) / "pgid"
    pgid = int(
        wait_until(
            lambda: pgid_file.exists() and pgid_file.read_text().strip(), what="pgid"
        )
    )
    # sh, and its background sleep: pgid is written as soon as sh is exec'd, before
    # it has necessarily forked anything.
    wait_until(lambda: len(live_processes_in_group(pgid)) >= 2, what="the group")

    # An outsider cannot cancel it (404, nothing changes).
    outsider = login(stack.base_url, "charlie", "pw-charlie")
    assert csrf_post(outsider, f"/jobs/{long}/cancel/", {}).status_code == 404
    assert Job.objects.get(pk=long).cancel_requested_at is None

    resp = csrf_post(client, f"/jobs/{long}/cancel/", {})
    assert resp.status_code == 302
    assert wait_for_job(long, set(Job.TERMINAL)) == "cancelled"
    assert live_processes_in_group(pgid) == []
    assert statuses(long) == ["pending", "starting", "running", "cancelled"]

    # Every GPU slot is free again and each finished attempt was charged.
    from scheduler.models import Allocation, UsageRecord

    assert not Allocation.objects.filter(released_at__isnull=True).exists()
    assert UsageRecord.objects.filter(attempt__job_id__in=[ok, bad, long]).count() == 3


def test_a_job_larger_than_any_node_runs_on_two_nodes_with_torchrun_ranks(
    stack: Stack, alice: User
) -> None:
    from scheduler import services
    from scheduler.models import Attempt, Job, Node

    for name in ("span-a", "span-b"):
        _, token = services.create_node(name)
        stack.start_agent(name, token, "2xA100-80GB")
        stack.procs["web"].wait_for(rf"agent of node {name} connected")
    wait_until(
        lambda: Node.objects.filter(status="up").count() == 2,
        what="both nodes' hello",
    )
    client = login(stack.base_url, "alice", "pw-alice")
    page = client.get("/jobs/new/")
    assert page.status_code == 200
    resp = csrf_post(
        client,
        "/jobs/new/",
        {
            "name": "ddp",
            "command": 'echo "rank=$PET_NODE_RANK of $PET_NNODES '
            'master=$MASTER_ADDR:$MASTER_PORT gpus=$CUDA_VISIBLE_DEVICES"',
            "workdir": "/tmp",
            "gpus": "4",
            "priority_class": "normal",
        },
    )
    assert resp.status_code == 302, resp.text
    job_id = int(resp.headers["location"].strip("/").split("/")[-1])

    assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"
    attempt = Attempt.objects.get(job_id=job_id)
    assert len(attempt.ranks) == 2
    master = Node.objects.get(pk=attempt.ranks[0]).name
    job = Job.objects.get(pk=job_id)
    wait_until(
        lambda: (
            "rank=1 of 2" in services.log_tail(job)
            and "rank=0 of 2" in services.log_tail(job)
        ),
        what="both ranks' output",
    )
    log = services.log_tail(job)
    assert f"master={master}:" in log
    assert log.count(f"master={master}:") == 2  # both ranks agree on the master
