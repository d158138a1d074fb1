"""Job pages: list, submit, detail (a live fragment its script fetches again when
the job's group says it changed; charts of its GPUs), cancel, hold and release."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db.models import Max, Q
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal import expected_end, preemption
from portal.accounting.reports import job_charges
from portal.forms import JobForm, format_duration
from portal.idle.models import IdleFlag
from portal.interactive.views import job_page_context
from portal.quotas.models import Quota
from portal.quotas.usage import quota_states
from scheduler import classes, livestate, metrics, services
from scheduler.models import Allocation, Attempt, Group, Job, JobLogChunk, Profile

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
    # whole picture is on the Usage page).
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
    groups = services.groups_of(request.user)
    group_names = [g.name for g in groups]
    initial = {}
    copy_of = request.GET.get("copy")
    if copy_of and copy_of.isascii() and copy_of.isdigit() and len(copy_of) < 19:
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
            if src.checkpointable:
                initial |= {
                    "checkpointable": True,
                    "checkpoint_signal": src.checkpoint_signal,
                    "checkpoint_grace": str(src.checkpoint_grace_s),
                }
    form = JobForm(
        request.POST or None,
        initial=initial,
        group_names=group_names,
        default_group=_default_group(request.user, groups),
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


def _events(job: Job) -> dict[str, Any]:
    """The job's latest ``GPULAB_JOB_EVENTS_MAX`` events, oldest first, and how
    many earlier ones are left out (a history can grow without end: a hold and
    a release are an event each)."""
    limit = settings.GPULAB_JOB_EVENTS_MAX
    events = list(job.events.select_related("actor").order_by("-at", "-id")[:limit])
    events.reverse()
    earlier = job.events.count() - len(events) if len(events) == limit else 0
    return {"events": events, "events_earlier": earlier}


def _job_context(job: Job) -> dict[str, Any]:
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
    # co-location: the jobs sharing its GPU now, or, once its attempt ended, the
    # jobs that held its GPU while it did; the viewer's own or not (only number,
    # owner and memory of someone else's are shown)
    partners: list[Job] = []
    if attempt is not None and len(allocations) == 1:
        held = allocations[0]
        if attempt.ended_at is None:
            overlap = Q(attempt_set__allocations__released_at__isnull=True)
        else:
            overlap = Q(
                attempt_set__allocations__allocated_at__lt=held.released_at
                or attempt.ended_at
            ) & (
                Q(attempt_set__allocations__released_at__isnull=True)
                | Q(attempt_set__allocations__released_at__gt=held.allocated_at)
            )
        partners = list(
            Job.objects.filter(overlap, attempt_set__allocations__gpu_id=held.gpu_id)
            .exclude(pk=job.pk)
            .select_related("owner")
            .distinct()
        )
    ahead: list[Job] = []
    if job.queue_position:
        # "Behind whom": the jobs just ahead of it in the last pass's order.
        ahead = list(Job.objects.ahead_of(job).select_related("owner")[:5])
    policy = services.policy_config()
    return {
        "trial": _trial_note(
            job,
            attempt,
            partners,
            policy.colo_detect_window_s,
            policy.colo_trial_evict_margin,
        ),
        "job": job,
        "attempt": attempt,
        "allocations": allocations,
        **_events(job),
        "log_tail": services.log_tail(job),
        "queue_position": job.queue_position,
        "ahead": ahead,
        "plans_with_prediction": policy.plans_with_prediction,
        "expected_end": expected_end.of(job, attempt, timezone.now(), policy),
        "yielding": preemption.of(job, attempt, timezone.now()),
        # the run-time factor's reach, when the policy has one
        "runtime_ref_s": policy.runtime_ref_s if policy.ranks_by_runtime else None,
        "partners": partners,
        # idle GPUs: the open flag, if the job is idle now
        "idle_flag": IdleFlag.objects.filter(job=job, cleared_at__isnull=True).first(),
    }


def _default_group(user: Any, groups: list[Group]) -> str:
    """The group a job is charged to when none is chosen, as the submit service
    picks it (``services.jobs._charge_group``): the primary group, else the
    first, else the default group a user in none joins."""
    primary = (
        Profile.objects.filter(user=user)
        .values_list("primary_group_id", flat=True)
        .first()
    )
    for group in groups:
        if group.pk == primary:
            return group.name
    return groups[0].name if groups else str(settings.GPULAB_DEFAULT_GROUP)


def _trial_note(
    job: Job,
    attempt: Attempt | None,
    partners: list[Job],
    window_s: float,
    clear_margin: float | None,
) -> dict[str, Any] | None:
    """What the page says of an exploration trial on the job's GPU, the job's own
    admission or the one of the partner that joined it (docs/colocation.md): the
    pair was admitted on its predicted gain alone, so its predicted slowdowns may
    be over the cap; the pass sends the job that joined back to the queue (if its
    owner allows) once a job of the GPU was measured over its cap by more than
    ``colo_trial_evict_margin`` (at its first measurement; when that is set), or
    over it at all for half of ``colo_detect_window_s``."""
    if attempt is None:
        return None
    joined: Job = job
    admission = attempt.admission
    if not admission or not admission.get("trial"):
        admission = None
        for other in Attempt.objects.filter(
            job__in=partners, admission__trial=True
        ).select_related("job"):
            if job.pk in (other.admission or {}).get("partners", ()):
                joined, admission = other.job, other.admission
                break
    if admission is None:
        return None
    spec = classes.get_class(job.priority_class)
    cap = spec.slowdown_cap if spec is not None else None
    if job.slowdown_cap is not None:
        cap = job.slowdown_cap if cap is None else min(cap, job.slowdown_cap)
    slowdowns = admission.get("slowdowns") or {}
    predicted = slowdowns.get(str(job.pk)) or max(slowdowns.values(), default=None)
    return {
        "joined": None if joined is job else joined.pk,
        "evictable": joined.evictable,
        "predicted": _times(predicted),
        "over_cap": predicted is not None and cap is not None and predicted > cap,
        "cap": _times(cap),
        "detect_min": f"{window_s / 2 / 60:g}",
        "clear_pct": None if clear_margin is None else f"{clear_margin * 100:g}",
        "window_min": f"{window_s / 60:g}",
    }


def _times(value: float | None) -> str:
    """A slowdown as people write it: 1.64x, 1.5x, 2x."""
    return "" if value is None else f"{value:.2f}".rstrip("0").rstrip(".") + "x"


# The job page's charts: the last minutes of its latest attempt's GPUs.
JOB_CHART_WINDOW = timedelta(minutes=15)


def job_chart_series(
    job: Job,
    attempt: Attempt | None,
    allocations: list[Allocation],
    *,
    shared: bool = False,
) -> dict[str, Any]:
    """Each GPU of the job's latest attempt over the last ``JOB_CHART_WINDOW`` it
    ran (one query): the GPU's utilisation and memory, and the memory the job's
    own processes held on it (``shared``: it shares its GPU, so the page draws
    both memories; else they are the same line)."""
    until = (attempt.ended_at if attempt else None) or timezone.now()
    since = until - JOB_CHART_WINDOW
    gpus: dict[int, dict[str, Any]] = {}
    for a in allocations:
        gpus[a.gpu_id] = {
            "key": livestate.gpu_key(a.gpu.node_id, a.gpu.index),
            "label": f"{a.gpu.node.name}:{a.gpu.index}",
            "mem_total": a.gpu.memory_total_mib,
            "t": [],
            "util": [],
            "mem": [],
            "own": [],
        }
    if gpus and attempt is not None:
        for row in metrics.job_history(job.pk, since=since):
            col = gpus.get(row["gpu_id"])
            if col is None or row["attempt_id"] != attempt.pk:
                continue
            own = [
                int(p["used_memory_mib"])
                for p in row["processes"] or ()
                if p.get("attempt_id") == attempt.pk
                and p.get("used_memory_mib") is not None
            ]
            col["t"].append(row["at"].timestamp())
            col["util"].append(row["util_gpu"])
            col["mem"].append(row["memory_used_mib"])
            col["own"].append(sum(own) if own else None)
    started = attempt.started_at or attempt.created_at if attempt else None
    return {
        "window_s": JOB_CHART_WINDOW.total_seconds(),
        "start": started.timestamp() if started else None,
        "shared": shared,
        "until": until.timestamp(),
        "live": attempt is not None and attempt.ended_at is None,
        "gpus": list(gpus.values()),
    }


def _log_marks(job: Job, attempt: Attempt | None) -> dict[str, Any]:
    """Where the stored output of each (attempt, node) ends, so the page appends
    only chunks after it; whether it spans nodes (then the page fetches the
    fragment instead, with its rank headers)."""
    last = {
        f"{r['attempt_id']}:{r['node_id']}": r["last"]
        for r in JobLogChunk.objects.filter(attempt__job=job)
        .values("attempt_id", "node_id")
        .annotate(last=Max("offset"))
    }
    return {
        "log_last": json.dumps(last),
        "log_spans_nodes": attempt is not None and len(attempt.node_ids) > 1,
    }


@login_required
def job_series(request: AuthenticatedHttpRequest, job_id: int) -> HttpResponse:
    job = _get_job_for_user(request, job_id)
    context = _job_context(job)
    return JsonResponse(
        job_chart_series(
            job,
            context["attempt"],
            context["allocations"],
            shared=bool(context["partners"]),
        )
    )


@login_required
def job_detail(request: AuthenticatedHttpRequest, job_id: int) -> HttpResponse:
    job = _get_job_for_user(request, job_id)
    context = _job_context(job)
    context.update(_log_marks(job, context["attempt"]))
    context["can_cancel"] = job.can_be_cancelled_by(request.user)
    context["charged"] = job_charges(job.pk)
    context["can_hold"] = job.can_be_held_by(request.user)
    context["can_release"] = job.can_be_released_by(request.user)
    context.update(job_page_context(job, context["attempt"], request.user))
    if request.htmx and not request.htmx.boosted:
        return render(request, "portal/partials/_job_fragment.html", context)
    context["series"] = job_chart_series(
        job,
        context["attempt"],
        context["allocations"],
        shared=bool(context["partners"]),
    )
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
