"""Who may open an interactive job's server through the proxy, and where it is.

One synchronous function (``resolve``) run off the event loop: the session
cookie's user (Django's own session engine and ``get_user``, so a changed
password or a logout ends access as it does for pages), the job, its live
attempt's server. Only the owner opens it; a staff member with
``scheduler.open_any_interactive`` too, each opening audited as a job event;
anyone else gets the same 404 as for a job that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from types import SimpleNamespace
from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib.auth import get_user
from django.db import close_old_connections, connections

from scheduler import services
from scheduler.models import Job

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

OPEN_ANY = "scheduler.open_any_interactive"


@dataclass(frozen=True)
class Target:
    """An open-able server: where to forward, and the token to present."""

    job_id: int
    user_id: int
    host: str
    port: int
    token: str


@dataclass(frozen=True)
class Refusal:
    """Why the proxy answers itself: status, a title and a sentence; ``retry``:
    the page reloads itself (the server is on its way); ``login``: send the
    browser to sign in first."""

    status: int
    title: str
    detail: str
    retry: bool = False
    login: bool = False


NOT_FOUND = Refusal(404, "Not found", "There is no such interactive job.")
WAITING = (Job.Status.PENDING, Job.Status.HELD, Job.Status.STARTING)


def session_user(session_key: str | None) -> User | AnonymousUser:
    engine = import_module(settings.SESSION_ENGINE)
    request = SimpleNamespace(session=engine.SessionStore(session_key))
    return get_user(request)  # type: ignore[arg-type]


def resolve(session_key: str | None, job_id: int) -> Target | Refusal:
    """Where the proxy forwards for this session and job, or why it does not."""
    close_old_connections()
    try:
        user = session_user(session_key)
        if not user.is_authenticated:
            return Refusal(
                401, "Sign in", "Sign in to open your interactive job.", login=True
            )
        job = Job.objects.filter(pk=job_id, interactive=Job.Interactive.JUPYTER).first()
        if job is None:
            return NOT_FOUND
        if job.owner_id != user.pk:
            if not user.has_perm(OPEN_ANY):
                return NOT_FOUND
            services.audit_staff_open(job, user)
        return _target(job, user.pk)
    finally:
        # Back to the pool (the web process runs with one): this thread holds
        # no connection between lookups.
        connections.close_all()


def _target(job: Job, user_id: int) -> Target | Refusal:
    name = f"Job #{job.pk}"
    if job.is_terminal:
        why = f": {job.end_reason}" if job.end_reason else ""
        return Refusal(
            410, "This interactive job has ended", f"{name} is {job.status}{why}."
        )
    if job.status in WAITING:
        return Refusal(
            503,
            "JupyterLab is not running yet",
            f"{name} is {job.status}: it opens here once it runs."
            + (f" {job.pending_message}" if job.pending_message else ""),
            retry=True,
        )
    server = services.live_server(job)
    if server is None:
        return Refusal(
            503,
            "JupyterLab is starting",
            f"{name} runs; its JupyterLab is starting.",
            retry=True,
        )
    return Target(job.pk, user_id, server.host, server.port, server.token)
