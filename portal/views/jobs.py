"""Job pages: list, submit, detail (with a polled live fragment), cancel, hold and
release."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from portal.accounting.reports import job_charges
from portal.forms import JobForm, format_duration
from portal.idle.models import IdleFlag
from portal.quotas.models import Quota
from portal.quotas.usage import quota_states
from scheduler import services
from scheduler.models import Allocation, Job

if TYPE_CHECKING:
    from collections.abc import Callable

    from portal.http import AuthenticatedHttpRequest


def _get_job_for_user(request: AuthenticatedHttpRequest, job_id: int) -> Job:
    """The job if the user may see it; 404 otherwise (no existence leak)."""
    job = (
        Job.objects.visible_to(request.user)
        .select_related("owner", "group")
        .filter(pk=job_id)
        .first()
    )
    if job is None:
        raise Http404("No such job")
    return job


@login_required
def job_list(request: AuthenticatedHttpRequest) -> HttpResponse:
    jobs = Job.objects.visible_to(request.user).select_related("owner", "group")
    status = request.GET.get("status", "")
    if status in Job.Status.values:
        jobs = jobs.filter(status=status)
    page = Paginator(jobs, 50).get_page(request.GET.get("page"))
    # The quotas the user's jobs are subject to, in their current period (the
    # full Usage page is another part of issue 6).
    quotas = quota_states(quotas=Quota.objects.for_user(request.user))
    return render(
        request,
        "portal/jobs.html",
        {
            "page": page,
            "status": status,
            "statuses": Job.Status.choices,
            "quotas": quotas,
        },
    )


@login_required
def job_new(request: AuthenticatedHttpRequest) -> HttpResponse:
    group_names = [g.name for g in services.groups_of(request.user)]
    initial = {}
    copy_of = request.GET.get("copy")
    if copy_of and copy_of.isdigit():
        src = Job.objects.visible_to(request.user).filter(pk=int(copy_of)).first()
        if src is not None:
            initial = {
                "name": src.name,
                "command": src.command,
                "workdir": src.workdir,
                "gpus": src.gpus,
                "gpu_memory": f"{src.gpu_memory_mib}M" if src.gpu_memory_mib else "",
                "time_limit": format_duration(src.time_limit_s),
                "priority_class": src.priority_class,
                "shareable": src.shareable,
                "workload": src.workload,
                "env": "\n".join(f"{k}={v}" for k, v in src.env.items()),
                "kill_grace": str(src.kill_grace_s),
                "gpu_model": src.gpu_model,
                "on_node_loss": "requeue" if src.requeue_on_node_loss else "fail",
            }
    form = JobForm(
        request.POST or None,
        initial=initial,
        group_names=group_names,
        gpu_models=services.gpu_models(),
    )
    if request.method == "POST" and form.is_valid():
        try:
            job = services.submit_job(request.user, form.to_request())
        except ValidationError as exc:
            form.add_service_errors(exc.message_dict)
        else:
            messages.success(request, f"Job #{job.pk} submitted.")
            return redirect("portal-job", job.pk)
    status = 400 if request.method == "POST" else 200
    return render(request, "portal/job_new.html", {"form": form}, status=status)


def _job_context(job: Job) -> dict[str, object]:
    attempt = job.attempt_set.select_related("node").order_by("-number").first()
    allocations = []
    if attempt is not None:
        allocations = sorted(
            {
                a.gpu_id: a
                for a in Allocation.objects.filter(attempt=attempt).select_related(
                    "gpu", "gpu__node"
                )
            }.values(),
            # Rank order (a job spanning nodes), then GPU index.
            key=lambda a: (
                (attempt.node_ids.index(a.gpu.node_id), a.gpu.index)
                if a.gpu.node_id in attempt.node_ids
                else (len(attempt.node_ids), a.gpu.index)
            ),
        )
    # co-location: the jobs sharing its GPU now, the viewer's own or not (only
    # number, owner and memory of someone else's are shown)
    partners: list[Job] = []
    if attempt is not None and attempt.ended_at is None and len(allocations) == 1:
        partners = list(
            Job.objects.filter(
                attempt_set__allocations__gpu_id=allocations[0].gpu_id,
                attempt_set__allocations__released_at__isnull=True,
            )
            .exclude(pk=job.pk)
            .select_related("owner")
            .distinct()
        )
    ahead: list[Job] = []
    if job.status == Job.Status.PENDING and job.queue_position:
        # "Behind whom": the jobs just ahead of it in the last pass's order.
        ahead = list(
            Job.objects.pending()
            .filter(queue_position__lt=job.queue_position)
            .select_related("owner")
            .order_by("-queue_position")[:5]
        )
    return {
        "job": job,
        "attempt": attempt,
        "allocations": allocations,
        "events": job.events.select_related("actor").order_by("at", "id"),
        "log_tail": services.log_tail(job),
        "queue_position": job.queue_position,
        "ahead": ahead,
        "plans_with_prediction": services.policy_config().plans_with_prediction,
        "partners": partners,
        # idle GPUs: the open flag, if the job is idle now
        "idle_flag": IdleFlag.objects.filter(job=job, cleared_at__isnull=True).first(),
    }


@login_required
def job_detail(request: AuthenticatedHttpRequest, job_id: int) -> HttpResponse:
    job = _get_job_for_user(request, job_id)
    context = _job_context(job)
    context["can_cancel"] = job.can_be_cancelled_by(request.user)
    context["charged"] = job_charges(job.pk)
    context["can_hold"] = job.can_be_held_by(request.user)
    context["can_release"] = job.can_be_released_by(request.user)
    if request.htmx and not request.htmx.boosted:
        return render(request, "portal/partials/_job_live.html", context)
    return render(request, "portal/job_detail.html", context)


@require_POST
@login_required
def job_cancel(request: AuthenticatedHttpRequest, job_id: int) -> HttpResponse:
    job = _get_job_for_user(request, job_id)
    if not job.can_be_cancelled_by(request.user):
        messages.error(request, f"Job #{job.pk} cannot be cancelled now.")
        return redirect("portal-job", job.pk)
    try:
        services.cancel_job(job.pk, by=request.user)
    except services.JobStateError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Cancelling job #{job.pk}.")
    return redirect("portal-job", job.pk)


def _job_verb(
    request: AuthenticatedHttpRequest,
    job_id: int,
    verb: Callable[..., object],
    done: str,
) -> HttpResponse:
    """Run a service verb on a job the user may see; its refusal (wrong state, not
    allowed) as an error message, else ``done``; back to the job's page."""
    job = _get_job_for_user(request, job_id)
    try:
        verb(job.pk, by=request.user)
    except (services.JobStateError, PermissionDenied) as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, done.format(id=job.pk))
    return redirect("portal-job", job.pk)


@require_POST
@login_required
def job_hold(request: AuthenticatedHttpRequest, job_id: int) -> HttpResponse:
    """Its owner holds their pending job (an admin with ``hold_job`` any)."""
    return _job_verb(
        request,
        job_id,
        services.hold_job,
        "Job #{id} is held: it waits until released.",
    )


@require_POST
@login_required
def job_release(request: AuthenticatedHttpRequest, job_id: int) -> HttpResponse:
    """Its owner releases their own hold (an admin with ``hold_job`` any hold)."""
    return _job_verb(
        request,
        job_id,
        services.release_job,
        "Job #{id} is released: it waits its turn.",
    )
