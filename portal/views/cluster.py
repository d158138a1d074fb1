"""Cluster pages: overview, queue, nodes, a node, a GPU; their chart series (JSON);
the node actions staff may take from the node's page.

Every page is server-rendered with the current state (a browser without
JavaScript sees it all); the page's script then subscribes to its live groups
(``portal.consumers``) and, on a reconnect, fetches the page's fragment or series
again from these same views.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Prefetch
from django.http import Http404, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal import preemption
from portal.templatetags.gpulab import duration
from scheduler import livestate, metrics, services
from scheduler.models import (
    NODE_MODE_VERBS,
    Allocation,
    Attempt,
    Gpu,
    Job,
    Node,
    attach_queue_positions,
)

if TYPE_CHECKING:
    from datetime import timedelta

    from portal.http import AuthenticatedHttpRequest

# The queue page lists waiting jobs this many at a time (in scheduling order).
QUEUE_PAGE = 100
# What its rows show and its permission checks read (not the command, the
# environment and the rest: a 100-row page loads only these).
QUEUE_FIELDS = (
    "name",
    "owner__username",
    "priority_class",
    "gpus",
    "gpu_model",
    "priority_breakdown",
    "queue_order",
    "pending_message",
    "est_start",
    "submitted_at",
    "started_at",
    "status",
    "cancel_requested_at",
    "held_by_id",
    "owner_id",
)
# What a running row reads to say it is being preempted (``portal.preemption``):
# its attempt's and its job's stop terms.
PREEMPTION_FIELDS = ("ended_at", "kill_reason", "kill_sent_at", "preempted_for")
STOP_FIELDS = (
    "checkpointable",
    "checkpoint_signal",
    "checkpoint_grace_s",
    "kill_grace_s",
)


def _partial(request: AuthenticatedHttpRequest) -> bool:
    return bool(request.htmx and not request.htmx.boosted)


def _grid_context(node_id: int | None = None) -> dict[str, Any]:
    state = livestate.cluster_state(node_id, headline=node_id is None)
    return {
        "state": state,
        "headline": state["headline"],
        "grid": livestate.grid(state),
    }


@login_required
def overview(request: AuthenticatedHttpRequest) -> HttpResponse:
    context = _grid_context()
    if _partial(request):
        return render(request, "portal/partials/_cluster.html", context)
    return render(request, "portal/overview.html", context)


@login_required
def node_list(request: AuthenticatedHttpRequest) -> HttpResponse:
    context = _grid_context()
    if _partial(request):
        return render(request, "portal/partials/_node_grid.html", context)
    return render(request, "portal/nodes.html", context)


# ------------------------------------------------------------------ queue


def queue_context(user: Any, page: str | None = None) -> dict[str, Any]:
    """Waiting jobs in the last pass's scheduling order, a page of QUEUE_PAGE at a
    time; held jobs; the jobs on nodes with where they run (at most QUEUE_PAGE of
    each of the last two, longest first)."""
    ordered = Job.objects.in_queue_order().select_related("owner").only(*QUEUE_FIELDS)
    pending = Paginator(ordered, QUEUE_PAGE).get_page(page)
    # A page of the queue in its order: the places follow from the page's first.
    attach_queue_positions(pending.object_list, first=pending.start_index())
    held = list(
        Job.objects.filter(status=Job.Status.HELD)
        .select_related("owner")
        .only(*QUEUE_FIELDS)
        .order_by("submitted_at", "id")[:QUEUE_PAGE]
    )
    live = (
        Allocation.objects.filter(released_at__isnull=True)
        .select_related("gpu__node")
        .only("attempt_id", "gpu__index", "gpu__node_id", "gpu__node__name")
    )
    attempts = list(
        Attempt.objects.filter(ended_at__isnull=True)
        .select_related("job__owner")
        .only(
            "job_id",
            *PREEMPTION_FIELDS,
            *(f"job__{f}" for f in (*QUEUE_FIELDS, *STOP_FIELDS)),
        )
        .prefetch_related(Prefetch("allocations", queryset=live, to_attr="live"))
        .order_by("job__started_at", "job_id")[:QUEUE_PAGE]
    )
    running = []
    now = timezone.now()
    for attempt in attempts:
        job = attempt.job
        # Chosen as a preemption's victim: the job it yields to, and when.
        job.yielding = preemption.of(job, attempt, now)  # type: ignore[attr-defined]
        gpus = sorted(
            {(a.gpu.node.name, a.gpu.index, a.gpu.node_id) for a in attempt.live}
        )
        job.where = [{"node": n, "index": i, "node_id": nid} for n, i, nid in gpus]  # type: ignore[attr-defined]
        running.append(job)
    rows: list[Any] = [*pending.object_list, *held, *running]
    # Which rows link to their job's page: one query for the page, by the same
    # rule as the page itself (a group's leader sees the group's jobs too).
    visible = set(
        Job.objects.visible_to(user)
        .filter(pk__in=[job.pk for job in rows])
        .values_list("pk", flat=True)
    )
    for job in rows:
        # What the viewer may do next to it (as on the job's page), and the
        # figures as text: formatted here, a row costs the template far less.
        job.visible = job.pk in visible
        job.can_cancel = job.can_be_cancelled_by(user)
        job.can_hold = job.can_be_held_by(user)
        job.can_release = job.can_be_released_by(user)
        job.waited = duration(now - job.submitted_at)
        job.ran = duration(now - job.started_at) if job.started_at else "\u2013"
        items = job.breakdown_items
        job.priority_text = f"{job.priority:.0f}" if items else "\u2013"
        job.breakdown_text = " + ".join(f"{k} {v:.0f}" for k, v in items)
    return {
        "pending": pending.object_list,
        "pending_page": pending,
        "pending_count": pending.paginator.count,
        "held": held,
        "running": running,
        "page_size": QUEUE_PAGE,
        # Rows build their links from this (DESIGN.md fixes /jobs/<id>/...):
        # a reverse() per row and action would cost a 100-row page a third of its time.
        "jobs_prefix": reverse("portal-jobs"),
    }


@login_required
def queue(request: AuthenticatedHttpRequest) -> HttpResponse:
    context = queue_context(request.user, request.GET.get("page"))
    if _partial(request):
        return render(request, "portal/partials/_queue.html", context)
    return render(request, "portal/queue.html", context)


# ------------------------------------------------------------------ node, GPU


def _range(request: AuthenticatedHttpRequest) -> tuple[str, timedelta]:
    return metrics.parse_range(request.GET.get("range"))


def _attempt_labels(attempt_ids: set[int]) -> dict[int, dict[str, Any]]:
    rows = Attempt.objects.filter(pk__in=attempt_ids).values_list(
        "pk", "job_id", "job__name", "job__owner__username"
    )
    return {
        pk: {"job": job, "label": f"#{job} {name} ({owner})"}
        for pk, job, name, owner in rows
    }


def chart_series(gpus: list[Gpu], span: timedelta, range_name: str) -> dict[str, Any]:
    """The node and GPU pages' charts: each GPU's readings and the memory each
    job (or foreign process) held, over the range, at the range's resolution.
    Two indexed queries on the history, one for the jobs' names."""
    until = timezone.now()
    since = until - span
    ids = [g.pk for g in gpus]
    resolution, columns = metrics.gpus_series(ids, since, until)
    procs = metrics.process_series(ids, since, until, resolution)
    labels = _attempt_labels({p["attempt"] for p in procs if p["attempt"]})
    by_id = {g.pk: g for g in gpus}
    out_procs = []
    for p in procs:
        gpu = by_id[p["gpu"]]
        owner = labels.get(p["attempt"]) if p["attempt"] else None
        if p["attempt"] is None:
            label, job = f"foreign pid {p['pid']}", None
        elif owner is None:
            label, job = f"attempt {p['attempt']}", None
        else:
            label, job = owner["label"], owner["job"]
        if len(gpus) > 1:
            label = f"GPU {gpu.index}: {label}"
        out_procs.append(
            {
                "gpu": livestate.gpu_key(gpu.node_id, gpu.index),
                "attempt": p["attempt"],
                "job": job,
                "pid": p["pid"],
                "label": label,
                "t": p["t"],
                "mib": p["mib"],
            }
        )
    return {
        "range": range_name,
        "span_s": span.total_seconds(),
        "resolution": resolution,
        "since": since.timestamp(),
        "until": until.timestamp(),
        "gpus": [
            {
                "key": livestate.gpu_key(g.node_id, g.index),
                "index": g.index,
                "label": f"GPU {g.index}",
                "mem_total": g.memory_total_mib,
                **columns[g.pk],
            }
            for g in gpus
        ],
        "procs": out_procs,
    }


def _node_or_404(node_id: int) -> Node:
    return get_object_or_404(Node, pk=node_id)


def _bad_range(exc: metrics.BadRange) -> HttpResponse:
    return HttpResponseBadRequest(f"Bad request: {exc}.", content_type="text/plain")


@login_required
def node_detail(request: AuthenticatedHttpRequest, node_id: int) -> HttpResponse:
    node = _node_or_404(node_id)
    try:
        range_name, span = _range(request)
    except metrics.BadRange as exc:
        return _bad_range(exc)
    context = _grid_context(node_id)
    if _partial(request):
        return render(request, "portal/partials/_node_grid.html", context)
    gpus = list(node.gpus.order_by("index"))
    context.update(
        {
            "node": node,
            "range": range_name,
            "ranges": list(metrics.RANGES),
            "series": chart_series(gpus, span, range_name),
            "can_set_mode": request.user.has_perm("scheduler.drain_node"),
        }
    )
    return render(request, "portal/node_detail.html", context)


@login_required
def node_series(request: AuthenticatedHttpRequest, node_id: int) -> HttpResponse:
    node = _node_or_404(node_id)
    try:
        range_name, span = _range(request)
    except metrics.BadRange as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse(
        chart_series(list(node.gpus.order_by("index")), span, range_name)
    )


def _gpu_or_404(node_id: int, index: int) -> Gpu:
    gpu = (
        Gpu.objects.select_related("node").filter(node_id=node_id, index=index).first()
    )
    if gpu is None:
        raise Http404("No such GPU")
    return gpu


@login_required
def gpu_detail(
    request: AuthenticatedHttpRequest, node_id: int, index: int
) -> HttpResponse:
    gpu = _gpu_or_404(node_id, index)
    try:
        range_name, span = _range(request)
    except metrics.BadRange as exc:
        return _bad_range(exc)
    context = _grid_context(node_id)
    live = context["state"]["gpus"].get(livestate.gpu_key(node_id, index))
    processes = (gpu.latest or {}).get("processes") or []
    labels = _attempt_labels(
        {p["attempt_id"] for p in processes if p.get("attempt_id")}
    )
    context.update(
        {
            "node": gpu.node,
            "gpu": gpu,
            "live": live,
            "processes": [
                {**p, "owner": labels.get(p.get("attempt_id"))} for p in processes
            ],
            "range": range_name,
            "ranges": list(metrics.RANGES),
            "series": chart_series([gpu], span, range_name),
        }
    )
    return render(request, "portal/gpu_detail.html", context)


@login_required
def gpu_series(
    request: AuthenticatedHttpRequest, node_id: int, index: int
) -> HttpResponse:
    gpu = _gpu_or_404(node_id, index)
    try:
        range_name, span = _range(request)
    except metrics.BadRange as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse(chart_series([gpu], span, range_name))


@require_POST
@login_required
def node_mode(request: AuthenticatedHttpRequest, node_id: int) -> HttpResponse:
    """Drain, maintenance or resume, for staff with ``drain_node`` (as the admin
    console's node actions)."""
    node = _node_or_404(node_id)
    mode = request.POST.get("mode", "")
    if mode not in NODE_MODE_VERBS:
        return HttpResponseBadRequest(
            "Bad request: mode must be drain, maintenance or resume.",
            content_type="text/plain",
        )
    # The service checks drain_node (PermissionDenied: 403) and logs the change
    # in the node's admin history under the user's name.
    changed = services.set_node_mode(node.pk, mode, by=request.user)
    done = {"drain": "draining", "maintenance": "in maintenance", "resume": "resumed"}
    if changed:
        messages.success(request, f"{node.name} is {done[mode]}.")
    else:
        messages.info(request, f"{node.name} was already {done[mode]}.")
    return redirect("portal-node", node.pk)
