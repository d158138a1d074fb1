"""The API's checkpoint fields: a strict bool, a named signal, a bounded grace,
all shown back with how often the job was resumed and the work it lost."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from scheduler.models import Attempt, Job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db

JOB = {"name": "resnet", "command": "python train.py", "workdir": "/home/alice"}


def test_a_checkpointable_job_is_shown_back(as_alice: Api, cluster: list[Node]) -> None:
    got = as_alice.post(
        "/api/v1/jobs/",
        {
            **JOB,
            "checkpointable": True,
            "checkpoint_signal": "SIGUSR1",
            "checkpoint_grace_s": 300,
        },
    )
    assert got.status_code == 201, got.json()
    body = got.json()
    assert body["checkpointable"] is True
    assert body["checkpoint_signal"] == "USR1"
    assert body["checkpoint_grace_s"] == 300
    assert (body["restarts"], body["lost_work_gpu_s"]) == (0, 0)


def test_defaults_are_shown_for_a_plain_job(as_alice: Api, cluster: list[Node]) -> None:
    body = as_alice.post("/api/v1/jobs/", JOB).json()
    assert body["checkpointable"] is False
    assert (body["checkpoint_signal"], body["checkpoint_grace_s"]) == ("TERM", 60)


@pytest.mark.parametrize(
    ("data", "field", "says"),
    [
        ({"checkpointable": "true"}, "checkpointable", "Must be true or false."),
        ({"checkpointable": 1}, "checkpointable", "Must be true or false."),
        (
            {"checkpointable": True, "checkpoint_signal": "HUP"},
            "checkpoint_signal",
            "choose one of: TERM, INT, USR1, USR2",
        ),
        (
            {"checkpointable": True, "checkpoint_grace_s": 99999},
            "checkpoint_grace_s",
            "less than or equal to 3600",
        ),
        (
            {"checkpoint_grace_s": 120},
            "checkpoint_grace_s",
            "only applies to a checkpointable job",
        ),
    ],
    ids=["string", "number", "signal", "grace", "grace-not-checkpointable"],
)
def test_bad_checkpoint_fields_are_a_400_naming_them(
    as_alice: Api, cluster: list[Node], data: dict[str, Any], field: str, says: str
) -> None:
    got = as_alice.post("/api/v1/jobs/", {**JOB, **data})
    assert got.status_code == 400, got.json()
    fields = got.json()["fields"]
    assert set(fields) == {field}
    assert says in fields[field][0]
    assert not Job.objects.exists()


def test_the_api_counts_restarts_and_lost_work(
    as_alice: Api, alice: User, cluster: list[Node]
) -> None:
    from django.utils import timezone

    from tests.factories import JobFactory

    job = JobFactory(owner=alice, checkpointable=True, attempts=2, preemptions=1)
    now = timezone.now()
    Attempt.objects.create(
        job=job, number=1, node=cluster[0], started_at=now, ended_at=now,
        lost_work_gpu_s=840,
    )  # fmt: skip
    Attempt.objects.create(job=job, number=2, node=cluster[0], started_at=now)
    body = as_alice.get(f"/api/v1/jobs/{job.pk}/").json()
    assert (body["restarts"], body["lost_work_gpu_s"]) == (1, 840)
