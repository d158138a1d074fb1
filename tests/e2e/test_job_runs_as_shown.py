"""What is accepted is what runs (issue 27), on real processes: a job submitted
through the API gets exactly the environment it was accepted with (a name the
shell would drop is refused up front instead of vanishing) and runs in the
normalised working directory that the API and the job page show."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import Stack, new_bearer, wait_for_job, wait_until

if TYPE_CHECKING:
    from pathlib import Path

    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_the_job_gets_the_env_and_workdir_it_was_accepted_with(
    stack: Stack, alice: User, tmp_path: Path
) -> None:
    from scheduler import services
    from scheduler.models import Job

    stack.start_node("e2e-env", "1xA100-80GB", 1)
    (tmp_path / "runs").mkdir()
    api = httpx.Client(base_url=stack.base_url, headers=new_bearer(alice, "e2e"))
    job = {"name": "env", "command": "true", "workdir": str(tmp_path)}

    refused = api.post("/api/v1/jobs/", json={**job, "env": {"FOO\n": "1"}})
    assert refused.status_code == 400, refused.text
    assert "'FOO\\n'" in refused.json()["fields"]["env"][0]

    env = {"FOO": "1", "MULTI": "one\ntwo", "TAB": "a\tb", "BIDI": "x\u202ey"}
    got = api.post(
        "/api/v1/jobs/",
        json={
            **job,
            "workdir": f"{tmp_path}/x/../runs/.",
            "env": env,
            "command": 'pwd; printf "%s|" "$FOO" "$MULTI" "$TAB" "$BIDI"; echo',
        },
    )
    assert got.status_code == 201, got.text
    job_id = got.json()["id"]
    assert got.json()["workdir"] == str(tmp_path / "runs")
    assert got.json()["env"] == env

    assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"
    ran = Job.objects.get(pk=job_id)
    wanted = f"{tmp_path / 'runs'}\n" + "|".join(env.values()) + "|\n"
    log = wait_until(
        lambda: (tail := services.log_tail(ran)).endswith("|\n") and tail,
        what="the job's output",
    )
    assert log == wanted
