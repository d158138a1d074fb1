"""Interactive jobs' verbs beyond submission (``jobs.interactive_request``):
where a running one's server is, and the audit of staff who open another
user's."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from django.utils import timezone

from scheduler.models import Attempt, Job, JobEvent
from scheduler.services.common import _event

if TYPE_CHECKING:
    from django.contrib.auth.models import User

# A staff opening is recorded at most once per this long per job and person (a
# JupyterLab page makes hundreds of requests).
AUDIT_EVERY = timedelta(hours=1)
STAFF_OPEN = "interactive job opened by staff member"


@dataclass(frozen=True)
class Server:
    """Where a running interactive job's server listens, and its secret."""

    host: str
    port: int
    token: str
    command: str


def live_server(job: Job) -> Server | None:
    """The server of the job's live attempt, None before the agent reported it
    (or once the attempt ended)."""
    row = (
        Attempt.objects.filter(
            job_id=job.pk, ended_at__isnull=True, interactive_port__isnull=False
        )
        .values_list("interactive_host", "interactive_port", "interactive_command")
        .first()
    )
    if row is None:
        return None
    host, port, command = row
    assert port is not None  # filtered above
    return Server(host, port, job.interactive_token, command)


def audit_staff_open(job: Job, by: User) -> None:
    """Record that ``by`` (not the owner) opened the job's interactive server:
    a job event naming them, at most once per ``AUDIT_EVERY``."""
    since = timezone.now() - AUDIT_EVERY
    seen = JobEvent.objects.filter(
        job=job, actor=by, at__gte=since, message__startswith=STAFF_OPEN
    ).exists()
    if not seen:
        _event(
            job,
            f"{STAFF_OPEN} {by.get_username()} (permission open_any_interactive)",
            source=JobEvent.Source.USER,
            actor=by,
        )
