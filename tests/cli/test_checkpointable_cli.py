"""``gpulab submit --checkpointable`` and what ``gpulab show`` says of it, on the
live server."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.utils import timezone

from scheduler.models import Attempt, Job
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.cli.conftest import Gpulab

pytestmark = pytest.mark.django_db(transaction=True)


def test_submit_checkpointable_with_its_signal_and_grace(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    got = gpulab(
        "submit", "--checkpointable", "--checkpoint-signal", "USR1",
        "--checkpoint-grace", "2m", "--", "python", "train.py",
        user=alice,
    )  # fmt: skip
    assert got.exit_code == 0, got.output
    job = Job.objects.get()
    assert (job.checkpointable, job.checkpoint_signal, job.checkpoint_grace_s) == (
        True,
        "USR1",
        120,
    )


def test_a_signal_without_checkpointable_is_refused_naming_the_option(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    got = gpulab("submit", "--checkpoint-signal", "USR1", "--", "true", user=alice)
    assert got.exit_code != 0
    assert "--checkpoint-signal" in got.stderr
    assert "only applies to a checkpointable job" in got.stderr
    assert not Job.objects.exists()


def test_show_says_how_often_it_was_resumed_and_the_work_lost(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(
        owner=alice,
        checkpointable=True,
        checkpoint_signal="USR2",
        checkpoint_grace_s=90,
        attempts=3,
        preemptions=2,
    )
    now = timezone.now()
    for number, lost in ((1, 300), (2, 540), (3, None)):
        Attempt.objects.create(
            job=job, number=number, node=cluster[0], started_at=now,
            ended_at=None if lost is None else now, lost_work_gpu_s=lost,
        )  # fmt: skip
    got = gpulab("show", str(job.pk), user=alice)
    assert got.exit_code == 0, got.output
    line = next(ln for ln in got.stdout.splitlines() if ln.startswith("Checkpointable"))
    assert line.split(":", 1)[1].strip() == (
        "when preempted SIGUSR2, then SIGKILL after 90s; resumed 2 times,"
        " 14 min of work lost"
    )
    # the stop grace is not the checkpoint grace: each line says when it applies
    line = next(ln for ln in got.stdout.splitlines() if ln.startswith("Stop grace"))
    assert line.split(":", 1)[1].strip() == (
        "30s (SIGTERM, then SIGKILL) when cancelled or at its limit"
    )


def test_show_has_no_checkpoint_line_for_a_plain_job(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice)
    got = gpulab("show", str(job.pk), user=alice)
    assert "Checkpointable" not in got.stdout


def test_show_says_a_running_guest_yields_its_gpus(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(
        owner=alice, checkpointable=True, status=Job.Status.RUNNING, attempts=1
    )
    Attempt.objects.create(
        job=job, number=1, node=cluster[0], started_at=timezone.now(), guest=True
    )
    shown = gpulab("show", str(job.pk), user=alice).stdout
    line = next(ln for ln in shown.splitlines() if ln.startswith("Guest"))
    assert "requeued when that job can start" in line
    # its attempt over, it is a guest no more
    Attempt.objects.filter(job=job).update(ended_at=timezone.now())
    assert "Guest" not in gpulab("show", str(job.pk), user=alice).stdout
