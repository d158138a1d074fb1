"""The page of a job that joined a GPU another job was using: its charts carry
the GPU's samples while it runs and after it ended, and its page keeps naming
the job it shared with."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection
from django.test import Client

from agents import protocol
from scheduler import metrics, services
from scheduler.models import Attempt
from tests.conftest import make_node
from tests.factories import (
    JobFactory,
    exited_data,
    shared_start,
    start_job,
    started_data,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Job

pytestmark = pytest.mark.django_db

MINUTES = 4


@pytest.fixture
def joined(alice: User, bob: User) -> tuple[Job, Job]:
    """bob's ``second`` joined alice's ``first`` on the only GPU 10 minutes ago;
    the agent sampled the GPU (both jobs' processes) each of the last minutes."""
    node, _ = make_node("node-a", 1)
    gpu = node.gpus.get()
    first = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4096, name="rn18")
    first_attempt = start_job(first, node)
    services.mark_started(node.pk, started_data(first_attempt, time.time() - 1200))
    second = JobFactory(owner=bob, shareable=True, gpu_memory_mib=6144, name="lm")
    assert services.apply_decisions(
        [shared_start(second, gpu.pk, node.pk, (first.pk,))]
    ).started
    second_attempt = Attempt.objects.get(job=second)
    services.mark_started(node.pk, started_data(second_attempt, time.time() - 600))
    now = datetime.now(tz=UTC)
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, now)
    for m in range(MINUTES, 0, -1):
        frame = protocol.MetricsData(
            sampled_at=(now - timedelta(minutes=m)).timestamp(),
            gpus=[
                protocol.GpuSample(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    util_gpu=90.0,
                    memory_used_mib=8000,
                    processes=[
                        protocol.ProcessSample(
                            pid=10, used_memory_mib=3000, attempt_id=first_attempt.pk
                        ),
                        protocol.ProcessSample(
                            pid=11, used_memory_mib=5000, attempt_id=second_attempt.pk
                        ),
                    ],
                )
            ],
        )
        metrics.store_samples({gpu.index: gpu.pk}, frame, now=now)
    return first, second


def get(user: User, url: str) -> Any:
    client = Client()
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200
    return response


def points(series: dict[str, Any]) -> list[tuple[float, float, int]]:
    (gpu,) = series["gpus"]
    return list(zip(gpu["util"], gpu["own"], gpu["mem"], strict=True))


@pytest.mark.parametrize("which", ["first", "second"])
def test_each_job_on_a_shared_gpu_charts_its_samples_while_it_runs(
    alice: User, bob: User, joined: tuple[Job, Job], which: str
) -> None:
    first, second = joined
    job, owner, own = (first, alice, 3000) if which == "first" else (second, bob, 5000)

    series = get(owner, f"/jobs/{job.pk}/series/").json()

    assert series["shared"] is True
    assert points(series) == [(90.0, own, 8000)] * MINUTES


def test_the_job_that_joined_keeps_its_charts_and_partner_after_it_ends(
    alice: User, bob: User, joined: tuple[Job, Job]
) -> None:
    first, second = joined
    node_id = first.attempt_set.get().node_id
    services.finish_attempt(node_id, exited_data(second.attempt_set.get()))

    series = get(bob, f"/jobs/{second.pk}/series/").json()
    body = " ".join(get(bob, f"/jobs/{second.pk}/").content.decode().split())

    assert series["live"] is False
    assert points(series) == [(90.0, 5000, 8000)] * MINUTES
    assert f'data-testid="partners">job #{first.pk} (alice, 4.0 GiB declared)' in body


def test_a_trial_says_why_it_may_exceed_the_cap_and_for_how_long(
    alice: User, bob: User, settings: Any
) -> None:
    from scheduler.policy.colocate import Admission
    from scheduler.services import policy_config

    node, _ = make_node("node-t", 1)
    gpu = node.gpus.get()
    first = JobFactory(owner=alice, shareable=True, gpu_memory_mib=4096)
    start_job(first, node)
    second = JobFactory(owner=bob, shareable=True, gpu_memory_mib=4096)
    trial = Admission(
        second.pk, gpu.pk, admitted=True, rule="ok", trial=True,
        message="exploration trial: predicted gain 1.10",
        slowdowns={second.pk: 1.64, first.pk: 1.2}, gain=1.1, confidence=0.2,
        partners=(first.pk,),
    )  # fmt: skip
    start = shared_start(second, gpu.pk, node.pk, (first.pk,))
    assert services.apply_decisions([replace(start, admission=trial)]).started
    window_min = policy_config().colo_detect_window_s / 60

    def note(user: User, job: Job) -> str:
        body = " ".join(get(user, f"/jobs/{job.pk}/").content.decode().split())
        return body.split('data-testid="trial-note">', 1)[1].split("</dd>", 1)[0]

    joiner, resident = note(bob, second), note(alice, first)

    assert "never been seen sharing a GPU" in joiner
    assert "1.64x, may exceed its cap of 1.5x" in joiner  # its prediction, its cap
    assert f"{window_min / 2:g} minutes" in joiner  # measured over it that long
    assert "by more than" not in joiner  # the fast end of a trial is off
    assert f"within {window_min:g} minutes" in joiner
    assert "this job (the one that joined) is sent back to the queue" in joiner
    # a trial whose job cannot be measured ends too (colocate._unmeasured)
    assert (
        f"if a job cannot be measured after {window_min / 2:g} minutes, this job is"
        " sent back too"
    ) in joiner
    # The job it joined: its own prediction (under its cap), who would leave.
    assert "may exceed" not in resident  # 1.2x, under its cap
    assert f"job #{second.pk} (the one that joined) is sent back" in resident
    # With the fast end of a trial set, the note says a clear overrun ends sooner.
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "colo_trial_evict_margin": 0.1}
    joiner = note(bob, second)
    assert "by more than 10 % at its first measurements, or over it at all" in joiner
