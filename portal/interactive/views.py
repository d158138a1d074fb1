"""The pages' side of interactive jobs: what the job page shows of one, and the
short form that starts a JupyterLab."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render

from portal.interactive.access import OPEN_ANY
from scheduler import classes, services
from scheduler.models import Attempt, Job

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User
    from django.http import HttpResponse

    from portal.http import AuthenticatedHttpRequest
    from scheduler.services.jobs import JobRequest


def open_url(job_id: int) -> str:
    """Where the proxy serves the job's JupyterLab (its Lab page)."""
    return f"/interactive/{job_id}/lab"


def job_page_context(
    job: Job, attempt: Attempt | None, user: User | AnonymousUser
) -> dict[str, Any]:
    """For the job page: whether to offer **Open** (a running JupyterLab whose
    server the agent reported, to its owner or a staff member allowed to open
    any) and the command that ran (of the latest attempt that started one)."""
    if not job.interactive:
        return {}
    command = ""
    if attempt is not None:
        command = attempt.interactive_command
    may = job.owner_id == user.pk or user.has_perm(OPEN_ANY)
    ready = (
        job.interactive == Job.Interactive.JUPYTER
        and job.status == Job.Status.RUNNING
        and attempt is not None
        and attempt.ended_at is None
        and attempt.interactive_port is not None
    )
    return {
        "interactive_command": command,
        "interactive_open_url": open_url(job.pk) if ready and may else "",
        "interactive_starting": (
            job.interactive == Job.Interactive.JUPYTER
            and job.status == Job.Status.RUNNING
            and not ready
        ),
    }


class JupyterForm(forms.Form):
    """The short form of an interactive job: its size, limit and sharing."""

    gpus = forms.IntegerField(min_value=1, initial=1, label="GPUs")
    gpu_memory_mib = forms.IntegerField(
        min_value=1, required=False, label="GPU memory (MiB)"
    )
    time_limit_h = forms.FloatField(
        min_value=0.01, required=False, label="Time limit (hours)"
    )
    shareable = forms.BooleanField(required=False, label="May share a GPU")
    workdir = forms.CharField(
        required=False,
        max_length=1024,
        label="Working directory",
        help_text="An absolute path (default: GPULAB_DEFAULT_WORKDIR).",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = classes.interactive_class()
        limit = self.fields["time_limit_h"]
        limit.help_text = (
            f"Default {spec.default_time_limit / 3600:g} h,"
            f" at most {spec.max_time_limit / 3600:g} h."
        )

    def request(self, kind: str = "jupyter") -> JobRequest:
        data = self.cleaned_data
        hours = data.get("time_limit_h")
        return services.interactive_request(
            kind,
            gpus=data["gpus"],
            gpu_memory_mib=data.get("gpu_memory_mib"),
            time_limit_s=None if hours is None else max(1, round(hours * 3600)),
            shareable=bool(data.get("shareable")),
            workdir=data.get("workdir") or "",
        )


def interactive_limits() -> dict[str, Any]:
    """What the jobs/submit page says of interactive jobs."""
    return {"max_per_user": settings.GPULAB_INTERACTIVE_MAX_PER_USER}


@login_required
def jupyter_new(request: AuthenticatedHttpRequest) -> HttpResponse:
    """Start JupyterLab: the short form (GPUs, memory, limit, sharing); a job of
    the interactive class, refused over the per-user cap naming the job the
    user already has. Then its page, which offers **Open** once it runs."""
    form = JupyterForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            job = services.submit_job(request.user, form.request("jupyter"))
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                target = _FORM_FIELDS.get(field)
                for error in errors:
                    form.add_error(target, error)
        else:
            messages.success(
                request, f"Job #{job.pk} submitted: JupyterLab opens here once it runs."
            )
            return redirect("portal-job", job.pk)
    status = 400 if request.method == "POST" else 200
    context = {"form": form, "heading": "Start JupyterLab", **interactive_limits()}
    return render(request, "portal/jupyter_new.html", context, status=status)


# The service's field names -> the form's (others are the form's own errors).
_FORM_FIELDS = {
    "gpus": "gpus",
    "gpu_memory_mib": "gpu_memory_mib",
    "time_limit_s": "time_limit_h",
    "shareable": "shareable",
    "workdir": "workdir",
}
