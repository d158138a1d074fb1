"""Cluster pages: overview, queue, nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib.auth.decorators import login_required
from django.db.models import Prefetch
from django.http import Http404, HttpResponse
from django.shortcuts import render

from scheduler import services
from scheduler.models import Allocation, Gpu, Job, Node

if TYPE_CHECKING:
    from portal.http import AuthenticatedHttpRequest


def _nodes_with_gpus() -> list[Node]:
    live = Allocation.objects.filter(released_at__isnull=True).select_related(
        "attempt__job__owner"
    )
    gpus = Gpu.objects.order_by("index").prefetch_related(
        Prefetch("allocations", queryset=live, to_attr="live")
    )
    # django-stubs cannot type a nested Prefetch with to_attr (it varies by run).
    nodes = list(
        Node.objects.prefetch_related(Prefetch("gpus", queryset=gpus))  # type: ignore[arg-type, misc, unused-ignore]
    )
    for node in nodes:
        for gpu in node.gpus.all():
            jobs = {a.attempt.job_id: a.attempt.job for a in gpu.live}  # type: ignore[attr-defined]
            attempts = {a.attempt.job_id: a.attempt_id for a in gpu.live}  # type: ignore[attr-defined]
            # each job's memory as measured now: its processes on this GPU
            used: dict[int, int] = {}
            for proc in (gpu.latest or {}).get("processes") or ():
                if proc.get("attempt_id") is not None:
                    aid = int(proc["attempt_id"])
                    used[aid] = used.get(aid, 0) + int(proc.get("used_memory_mib") or 0)
            for job_id, job in jobs.items():
                job.used_mib = used.get(attempts[job_id])
            gpu.jobs = list(jobs.values())  # type: ignore[attr-defined]
    return nodes


@login_required
def overview(request: AuthenticatedHttpRequest) -> HttpResponse:
    context = {"summary": services.gpu_summary(), "nodes": _nodes_with_gpus()}
    if request.htmx and not request.htmx.boosted:
        return render(request, "portal/partials/_cluster.html", context)
    return render(request, "portal/overview.html", context)


@login_required
def queue(request: AuthenticatedHttpRequest) -> HttpResponse:
    pending = list(
        Job.objects.pending()
        .select_related("owner", "group")
        .order_by("queue_position", "submitted_at", "id")
    )
    running = Job.objects.filter(status__in=Job.ON_NODE).select_related(
        "owner", "group"
    )
    return render(
        request, "portal/queue.html", {"pending": pending, "running": running}
    )


@login_required
def node_list(request: AuthenticatedHttpRequest) -> HttpResponse:
    return render(request, "portal/nodes.html", {"nodes": _nodes_with_gpus()})


@login_required
def node_detail(request: AuthenticatedHttpRequest, node_id: int) -> HttpResponse:
    node = next((n for n in _nodes_with_gpus() if n.pk == node_id), None)
    if node is None:
        raise Http404("No such node")
    return render(request, "portal/node_detail.html", {"node": node, "nodes": [node]})
