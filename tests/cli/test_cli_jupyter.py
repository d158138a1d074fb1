"""``gpulab jupyter`` against a live server: it submits an interactive job,
waits until it runs and prints the portal's address of its JupyterLab, never
the token; the per-user cap comes back naming the job the user has."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from scheduler import services
from scheduler.models import Job
from tests.factories import start_job, started_data

if TYPE_CHECKING:
    from pathlib import Path

    from click.testing import Result
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.cli.conftest import Gpulab


def test_no_wait_prints_the_address_and_submits_to_the_interactive_class(
    gpulab: Gpulab, alice: User, cluster: list[Node], tmp_path: Path
) -> None:
    got = gpulab("jupyter", "--gpus", "2", "--time", "3h", "--no-wait", user=alice)
    assert got.exit_code == 0, got.output
    job = Job.objects.get()
    url = f"{gpulab.server}/interactive/{job.pk}/lab"
    assert got.stdout == f"Submitted JupyterLab as job {job.pk}; it opens at {url}\n"
    assert (job.interactive, job.priority_class) == ("jupyter", "interactive")
    assert (job.gpus, job.time_limit_s, job.workdir) == (2, 3 * 3600, str(tmp_path))
    assert job.interactive_token not in got.output

    again = gpulab("jupyter", "--no-wait", user=alice)
    assert again.exit_code == 2
    assert f"you already have #{job.pk}" in again.stderr


def test_it_waits_until_the_job_runs_then_prints_where_to_open_it(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    result: dict[str, Result] = {}
    cli = threading.Thread(
        target=lambda: result.setdefault("got", gpulab("jupyter", user=alice))
    )
    cli.start()
    try:
        job = _wait_for(lambda: Job.objects.filter(owner=alice).first())
        attempt = start_job(job, cluster[0])
        services.mark_started(attempt.node_id, started_data(attempt))
    finally:
        cli.join(60)
    got = result["got"]
    assert got.exit_code == 0, got.output
    url = f"{gpulab.server}/interactive/{job.pk}/lab"
    assert got.stdout.splitlines()[-1] == f"JupyterLab runs (job {job.pk}); open {url}"


def _wait_for(fetch: Any, timeout: float = 30.0) -> Any:
    done = threading.Event()
    deadline = 0.0
    while deadline < timeout:
        got = fetch()
        if got is not None:
            return got
        done.wait(0.1)
        deadline += 0.1
    raise AssertionError("the CLI submitted nothing")
