"""**Open a terminal**: the short form that submits an interactive terminal job
(``services.interactive_request("shell", ...)``, the one submission path of
interactive jobs), whose page then shows the terminal once it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render

from portal.interactive.views import interactive_limits
from scheduler import classes, services

if TYPE_CHECKING:
    from django.http import HttpResponse

    from portal.http import AuthenticatedHttpRequest
    from scheduler.services.jobs import JobRequest


class TerminalForm(forms.Form):
    """An interactive job's size, limit and sharing (its command is the
    product's: a job that holds its GPUs for terminals)."""

    gpus = forms.IntegerField(min_value=1, initial=1, label="GPUs")
    gpu_memory_mib = forms.IntegerField(
        min_value=1, required=False, label="GPU memory (MiB)"
    )
    time_limit_h = forms.FloatField(
        min_value=0.01, required=False, label="Time limit (hours)"
    )
    shareable = forms.BooleanField(required=False, label="May share a GPU")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = classes.interactive_class()
        self.fields["time_limit_h"].help_text = (
            f"Default {spec.default_time_limit / 3600:g} h,"
            f" at most {spec.max_time_limit / 3600:g} h."
        )

    def request(self) -> JobRequest:
        data = self.cleaned_data
        hours = data.get("time_limit_h")
        return services.interactive_request(
            "shell",
            gpus=data["gpus"],
            gpu_memory_mib=data.get("gpu_memory_mib"),
            time_limit_s=None if hours is None else max(1, round(hours * 3600)),
            shareable=bool(data.get("shareable")),
        )


# The service's field names -> the form's (others are the form's own errors).
_FORM_FIELDS = {
    "gpus": "gpus",
    "gpu_memory_mib": "gpu_memory_mib",
    "time_limit_s": "time_limit_h",
    "shareable": "shareable",
}


@login_required
def terminal_new(request: AuthenticatedHttpRequest) -> HttpResponse:
    """Open a terminal: submit the job (refused over the per-user cap of
    interactive jobs, naming the one the user has), then its page."""
    form = TerminalForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            job = services.submit_job(request.user, form.request())
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                for error in errors:
                    form.add_error(_FORM_FIELDS.get(field), error)
        else:
            messages.success(
                request,
                f"Job #{job.pk} submitted: its terminal opens here once it runs.",
            )
            return redirect("portal-job", job.pk)
    status = 400 if request.method == "POST" else 200
    context = {"form": form, "heading": "Open a terminal", **interactive_limits()}
    return render(request, "portal/terminal_new.html", context, status=status)
