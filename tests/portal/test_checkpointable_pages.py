"""A checkpointable job through the submit form and on its page: the signal and
grace as asked, and how often it was resumed and how much work it lost."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from scheduler.models import Attempt, Job
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


FORM = {
    "name": "resnet",
    "command": "python train.py",
    "workdir": "/home/alice/resnet",
    "gpus": "1",
    "priority_class": "best-effort",
}


def test_the_form_submits_a_checkpointable_job(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).post(
        reverse("portal-job-new"),
        {
            **FORM,
            "checkpointable": "on",
            "checkpoint_signal": "USR1",
            "checkpoint_grace": "2m",
        },
    )
    assert response.status_code == 302, response.content.decode()
    job = Job.objects.get()
    assert (job.checkpointable, job.checkpoint_signal, job.checkpoint_grace_s) == (
        True,
        "USR1",
        120,
    )
    page = " ".join(
        client_for(alice).get(response["Location"]).content.decode().split()
    )
    assert (
        'data-field="checkpointable">resumed 0 times, 0 min of work lost;'
        " preempted: SIGUSR1, then SIGKILL after 2m"
    ) in page
    # the other stop line names the stops its SIGTERM and grace are for, so the
    # two lines do not read as two answers to one question
    assert (
        '<dt>When cancelled or at its limit</dt><dd data-field="kill_grace_s">'
        "SIGTERM, then SIGKILL after"
    ) in page


def test_the_form_names_a_checkpoint_field_a_plain_job_cannot_have(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).post(
        reverse("portal-job-new"), {**FORM, "checkpoint_signal": "USR2"}
    )
    body = response.content.decode()
    assert response.status_code == 400
    at = body.index('id="checkpoint_signal-error"')
    assert "only applies to a checkpointable job" in body[at : at + 300]
    assert not Job.objects.exists()


def test_the_page_says_how_often_it_was_resumed_and_the_work_lost(
    alice: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    job = JobFactory(
        owner=alice, checkpointable=True, gpus=2, attempts=3, preemptions=2
    )
    t = timezone.now() - timedelta(hours=3)
    for number, lost in ((1, 600 * 2), (2, 1080 * 2), (3, None)):
        Attempt.objects.create(
            job=job,
            number=number,
            node=node,
            started_at=t,
            ended_at=None if lost is None else t + timedelta(minutes=30),
            lost_work_gpu_s=lost,
        )
    page = " ".join(
        client_for(alice)
        .get(reverse("portal-job", args=[job.pk]))
        .content.decode()
        .split()
    )
    # 10 + 18 minutes on its 2 GPUs.
    assert 'data-field="checkpointable">resumed 2 times, 28 min of work lost;' in page


def test_a_plain_job_page_has_no_checkpoint_line(
    alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice)
    page = client_for(alice).get(reverse("portal-job", args=[job.pk])).content
    assert b'data-field="checkpointable"' not in page
    assert b'<dt>When stopped</dt><dd data-field="kill_grace_s">' in page
