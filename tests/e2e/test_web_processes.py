"""Several web processes on one port (``WEB_CONCURRENCY``, uvicorn's own variable;
README "Load and scale"): agents' sockets, the API and the pages land on any of
them, and a job still goes from the form to its node and back.

Every per-process piece (the metrics writer, the concurrency gate, the live
aggregator's Hub) is shared through PostgreSQL or Redis; this runs it for real."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import login, submit, wait_for_job, wait_until

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_jobs_run_through_two_web_processes(stack: Stack, alice: User) -> None:
    from scheduler import services
    from scheduler.models import Allocation, Gpu, Job, Node

    web = stack.restart_web("web-two", WEB_CONCURRENCY="2")
    started = [web.wait_for(r"Started server process \[(\d+)\]")]
    started.append(
        web.wait_for(
            r"Started server process \[(\d+)\]", start=web.lines.index(started[0]) + 1
        )
    )
    assert len(set(started)) == 2  # two processes, each its own pid

    nodes = []
    for name in ("wp-a", "wp-b"):
        node, token = services.create_node(name)
        stack.start_agent(name, token, "2xA100-80GB")
        web.wait_for(rf"agent of node {name} connected")
        nodes.append(node.pk)
    wait_until(
        lambda: Node.objects.filter(pk__in=nodes, status="up").count() == 2,
        what="both nodes' hellos",
    )

    client = login(stack.base_url, "alice", "pw-alice")
    jobs = [submit(client, f"through-{i}", f"echo done-{i}") for i in range(4)]
    for job_id in jobs:
        assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"
    ran_on = set(
        Allocation.objects.filter(attempt__job_id__in=jobs).values_list(
            "gpu__node_id", flat=True
        )
    )
    assert ran_on and ran_on <= set(nodes)
    # every GPU's latest state arrived, through whichever process holds its socket
    wait_until(
        lambda: not Gpu.objects.filter(node_id__in=nodes, latest_at=None).exists(),
        what="every GPU's latest state",
    )
