"""Typed factories and small builders for scheduler rows.

Jobs made here skip ``services.submit_job`` (no validation, no enqueue): use them to
arrange state. Starting and ending go through the services, the only writers of
attempts and allocations.
"""

from __future__ import annotations

import json
import time
from typing import Any

import factory
from factory.django import DjangoModelFactory

from agents import protocol
from scheduler import policy, services
from scheduler.models import Allocation, Attempt, Gpu, Job, Node


class JobFactory(DjangoModelFactory[Job]):
    class Meta:
        model = Job

    owner: Any = None
    group = factory.LazyAttribute(lambda o: o.owner.lab_groups.order_by("name").first())
    name = factory.Sequence(lambda n: f"train-{n}")
    command = "python train.py --epochs 10"
    workdir = "/home/lab"
    gpus = 1
    time_limit_s = 3600
    status = Job.Status.PENDING


def free_gpus(node: Node, count: int) -> list[Gpu]:
    """The first ``count`` GPUs of the node that hold no live allocation."""
    busy = Allocation.objects.filter(released_at__isnull=True).values("gpu_id")
    return list(node.gpus.exclude(pk__in=busy).order_by("index")[:count])


def start_job(job: Job, node: Node, gpus: list[Gpu] | None = None) -> Attempt:
    """Apply a policy ``Start`` for the job; return its new live attempt."""
    gpus = gpus if gpus is not None else free_gpus(node, job.gpus)
    result = services.apply_decisions(
        [policy.Start.on(job.pk, node.pk, tuple(g.pk for g in gpus))]
    )
    assert result.started == 1, result
    return Attempt.objects.get(job=job, ended_at__isnull=True)


def shared_start(
    job: Job, gpu_id: int, node_id: int, partners: tuple[int, ...]
) -> policy.Start:
    """A policy ``Start`` that puts ``job`` beside ``partners`` on ``gpu_id``, as
    the admission rule would (predicted 1.2x for it, 1.3x for them)."""
    from scheduler.policy.colocate import Admission

    adm = Admission(
        job.pk, gpu_id, admitted=True, rule="ok", message="predicted gain 1.60",
        slowdowns={job.pk: 1.2, **dict.fromkeys(partners, 1.3)}, gain=1.6,
        confidence=0.9, partners=partners,
    )  # fmt: skip
    return policy.Start(job.pk, (policy.Placement(node_id, (gpu_id,)),), admission=adm)


def started_data(attempt: Attempt, at: float | None = None) -> protocol.JobStartedData:
    return protocol.JobStartedData(
        attempt_id=attempt.pk,
        job_id=attempt.job_id,
        pid=4242,
        started_at=at if at is not None else time.time(),
    )


def exited_data(
    attempt: Attempt,
    exit_code: int | None = 0,
    *,
    at: float | None = None,
    reason: str = "exited",
    message: str = "",
) -> protocol.JobExitedData:
    return protocol.JobExitedData(
        attempt_id=attempt.pk,
        job_id=attempt.job_id,
        exit_code=exit_code,
        ended_at=at if at is not None else time.time(),
        reason=reason,  # type: ignore[arg-type]
        message=message,
    )


def agent_frame(model: type[protocol._Envelope], data: Any, seq: int) -> str:
    """An agent -> server frame as JSON text."""
    return model(seq=seq, ts=time.time(), data=data).model_dump_json()


def parse_command(command: dict[str, Any]) -> protocol.ServerMessage:
    """A server -> agent command dict, validated the way the agent reads it."""
    return protocol.parse_server_message(json.dumps(command))
