"""Nodes and GPUs (read; drain / maintenance / resume for admins), the queue,
my usage and quotas, who I am."""

from __future__ import annotations

from datetime import UTC, date
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings
from django.db.models import Prefetch
from django.http import Http404
from django.utils import timezone
from django.utils.functional import lazy
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from portal import preemption
from portal.accounting import reports
from portal.accounting.views import RangeForm, _scope_for
from portal.api.serializers import STATES, ListedFast, Text, attempts_of, latest_nodes
from portal.api.views.common import (
    attempts_for_nodes,
    errors,
    no_empty,
    node_names,
    page_of,
    query,
)
from portal.quotas.models import Quota
from portal.quotas.usage import quota_states
from scheduler import services
from scheduler.models import Allocation, Gpu, Job, Node, attach_queue_positions

if TYPE_CHECKING:
    from rest_framework.request import Request


# ------------------------------------------------------------------ nodes


class GpuJobOut(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    owner = serializers.CharField()
    name = serializers.CharField()


class GpuOut(serializers.Serializer[Any]):
    index = serializers.IntegerField()
    uuid = serializers.CharField()
    name = serializers.CharField()
    memory_total_mib = serializers.IntegerField()
    present = serializers.BooleanField()
    mig_enabled = serializers.BooleanField()
    util_gpu = serializers.FloatField(allow_null=True)
    memory_used_mib = serializers.FloatField(allow_null=True)
    temperature_c = serializers.FloatField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)
    sampled_at = serializers.DateTimeField(allow_null=True)
    jobs = GpuJobOut(many=True)


class NodeOut(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    name = serializers.CharField()
    state = serializers.CharField(help_text="up, lost or new (never connected)")
    mode = serializers.CharField(help_text="draining, maintenance or empty")
    takes_jobs = serializers.BooleanField()
    connected = serializers.BooleanField()
    last_seen_at = serializers.DateTimeField(allow_null=True)
    gpus = GpuOut(many=True)


def _number(sample: dict[str, Any], key: str) -> float | None:
    value = sample.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _nodes(node_id: int | None = None) -> list[dict[str, Any]]:
    live = Allocation.objects.filter(released_at__isnull=True).select_related(
        "attempt__job__owner"
    )
    gpus = Gpu.objects.order_by("index").prefetch_related(
        Prefetch("allocations", queryset=live, to_attr="live")
    )
    nodes = Node.objects.prefetch_related(Prefetch("gpus", queryset=gpus))  # type: ignore[arg-type, misc, unused-ignore]
    if node_id is not None:
        nodes = nodes.filter(pk=node_id)
    out = []
    for node in nodes:
        gpu_rows = []
        for gpu in node.gpus.all():
            jobs = {a.attempt.job_id: a.attempt.job for a in gpu.live}  # type: ignore[attr-defined]
            sample = gpu.latest or {}
            gpu_rows.append(
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "name": gpu.name,
                    "memory_total_mib": gpu.memory_total_mib,
                    "present": gpu.present,
                    "mig_enabled": gpu.mig_enabled,
                    "util_gpu": _number(sample, "util_gpu"),
                    "memory_used_mib": _number(sample, "memory_used_mib"),
                    "temperature_c": _number(sample, "temperature_c"),
                    "power_w": _number(sample, "power_w"),
                    "sampled_at": gpu.latest_at,
                    "jobs": [
                        {"id": j.pk, "owner": j.owner.username, "name": j.name}
                        for j in jobs.values()
                    ],
                }
            )
        out.append(
            {
                "id": node.pk,
                "name": node.name,
                "state": node.status,
                "mode": node.mode,
                "takes_jobs": node.takes_jobs,
                "connected": node.connected,
                "last_seen_at": node.last_seen_at,
                "gpus": gpu_rows,
            }
        )
    return out


class NodeList(APIView):
    @extend_schema(
        operation_id="nodes_list",
        responses={200: NodeOut(many=True), **errors()},
        summary="Every node with its GPUs, their latest sample and their jobs",
    )
    def get(self, request: Request) -> Response:
        return Response(NodeOut(_nodes(), many=True).data)


class NodeDetail(APIView):
    @extend_schema(
        operation_id="nodes_detail",
        responses={200: NodeOut, **errors(404)},
        summary="One node",
    )
    def get(self, request: Request, node_id: int) -> Response:
        got = _nodes(node_id)
        if not got:
            raise Http404(f"No node {node_id}.")
        return Response(NodeOut(got[0]).data)


class NodeModeOut(serializers.Serializer[Any]):
    changed = serializers.BooleanField()
    node = NodeOut()


class NodeMode(APIView):
    mode: services.NodeMode = "drain"

    def post(self, request: Request, node_id: int) -> Response:
        if not Node.objects.filter(pk=node_id).exists():
            raise Http404(f"No node {node_id}.")
        # checks drain_node (the admin console's permission) and writes history
        changed = services.set_node_mode(node_id, self.mode, by=request.user)  # type: ignore[arg-type]
        return Response(
            NodeModeOut({"changed": changed, "node": _nodes(node_id)[0]}).data
        )


def _mode(mode: services.NodeMode, summary: str) -> type[NodeMode]:
    @extend_schema(
        operation_id=f"nodes_{mode}",
        request=None,
        responses={200: NodeModeOut, **errors(403, 404)},
        summary=summary,
    )
    def post(self: NodeMode, request: Request, node_id: int) -> Response:
        return NodeMode.post(self, request, node_id)

    return type(f"Node{mode.title()}", (NodeMode,), {"mode": mode, "post": post})


NodeDrain = _mode("drain", "Drain a node: no new jobs, running ones finish (admins)")
NodeMaintenance = _mode("maintenance", "Put a node in maintenance (admins)")
NodeResume = _mode("resume", "Resume a drained node or one in maintenance (admins)")


# ------------------------------------------------------------------ queue


class QueueEntry(ListedFast, serializers.Serializer[Job]):
    id = serializers.IntegerField()
    name = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    group = serializers.CharField(source="group.name")
    state = serializers.ChoiceField(choices=STATES, source="status")
    priority_class = serializers.CharField()
    gpus = serializers.IntegerField()
    submitted_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    time_limit_s = serializers.IntegerField()
    queue_position = serializers.IntegerField(allow_null=True)
    reason = serializers.CharField(source="pending_reason")
    reason_message = serializers.CharField(source="pending_message")
    array = serializers.IntegerField(source="array_id", allow_null=True)
    array_index = serializers.IntegerField(allow_null=True)
    nodes = serializers.SerializerMethodField(
        help_text="The nodes of a running job, rank 0 first."
    )
    preempted_for = serializers.SerializerMethodField(
        help_text="A running job the scheduler chose to preempt: the waiting job it"
        " yields to (null otherwise, or if that job is gone)."
    )
    preempted_in_s = serializers.SerializerMethodField(
        help_text="Seconds until such a job is killed if it has not exited (what is"
        " left of its stop grace: a checkpointable job saves its work until then);"
        " null when it is not being preempted or its stop is still being sent."
    )

    def get_nodes(self, job: Job) -> list[str]:
        return latest_nodes(job, self.context.get("node_names", {}))

    def _yielding(self, job: Job) -> preemption.Yielding | None:
        if job.status not in Job.ON_NODE:
            return None
        live = [a for a in attempts_of(job) if a.ended_at is None]
        return preemption.of(job, live[0] if live else None, timezone.now())

    def get_preempted_for(self, job: Job) -> int | None:
        yielding = self._yielding(job)
        return None if yielding is None else yielding.for_job_id

    def get_preempted_in_s(self, job: Job) -> float | None:
        yielding = self._yielding(job)
        return None if yielding is None else yielding.in_s


class QueueQuery(serializers.Serializer[Any]):
    limit = serializers.IntegerField(
        required=False,
        default=settings.GPULAB_API_MAX_PAGE,
        min_value=1,
        max_value=settings.GPULAB_API_MAX_PAGE,
        help_text="At most this many jobs (default and maximum:"
        f" {settings.GPULAB_API_MAX_PAGE}, GPULAB_API_MAX_PAGE). The"
        " X-Total-Count header says how many there are, a Link header with"
        ' rel="next" where the next page is.',
    )
    offset = serializers.IntegerField(
        required=False,
        default=0,
        min_value=0,
        max_value=settings.GPULAB_API_MAX_OFFSET,
        help_text="Skip this many jobs of the queue (at most"
        f" {settings.GPULAB_API_MAX_OFFSET}, GPULAB_API_MAX_OFFSET).",
    )


class Queue(APIView):
    @extend_schema(
        operation_id="queue",
        parameters=[QueueQuery],
        responses={200: QueueEntry(many=True), **errors(400)},
        summary="The cluster's queue as the Queue page shows it: every running job,"
        " then every pending one in scheduling order, a page at a time",
    )
    def get(self, request: Request) -> Response:
        """One page of the queue (``limit`` jobs from ``offset``): the running jobs
        first, then the waiting ones; two counts and at most two page reads, so a
        queue of any length costs a page."""
        q = query(QueueQuery, request)
        limit, offset = q["limit"], q["offset"]
        running_q = Job.objects.filter(status__in=Job.ON_NODE).order_by(
            "started_at", "id"
        )
        pending_q = Job.objects.in_queue_order()
        read = Job.objects.select_related("owner", "group").prefetch_related(
            attempts_for_nodes()
        )
        n_running, n_pending = running_q.count(), pending_q.count()
        running = page_of(running_q, offset, limit, read) if offset < n_running else []
        skip = max(0, offset - n_running)
        room = limit - len(running)
        pending = page_of(pending_q, skip, room, read) if room > 0 else []
        attach_queue_positions(pending, first=skip + 1)  # running jobs have none
        response = Response(
            QueueEntry(
                [*running, *pending],
                many=True,
                context={"node_names": node_names()},
            ).data
        )
        total = n_running + n_pending
        response["X-Total-Count"] = str(total)
        if offset + limit < total:
            params = request.query_params.copy()
            params["offset"] = str(offset + limit)
            params["limit"] = str(limit)
            url = request.build_absolute_uri(f"{request.path}?{params.urlencode()}")
            response["Link"] = f'<{url}>; rel="next"'
        return response


# ------------------------------------------------------------------ usage, me


class UsageQuery(serializers.Serializer[Any]):
    group = Text(
        required=False, max_length=64, help_text="A group (its leaders, staff)."
    )


class QuotaOut(serializers.Serializer[Any]):
    scope = serializers.CharField(help_text="'group NAME' or 'user NAME'")
    hard = serializers.BooleanField()
    period = serializers.CharField()
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    gpu_hours = serializers.FloatField(allow_null=True)
    used_gpu_hours = serializers.FloatField()
    percent = serializers.FloatField(allow_null=True)
    max_gpus = serializers.IntegerField(allow_null=True)
    running_gpus = serializers.IntegerField()
    exhausted = serializers.BooleanField()


class TopJobOut(serializers.Serializer[Any]):
    job = serializers.IntegerField(source="job.pk")
    name = serializers.CharField(source="job.name")
    gpu_hours = serializers.FloatField()


class UsageOut(serializers.Serializer[Any]):
    first = serializers.DateField()
    last = serializers.DateField()
    scope = serializers.CharField()
    gpu_hours = serializers.FloatField()
    running_gpu_hours = serializers.FloatField()
    energy_kwh = serializers.FloatField(allow_null=True)
    efficiency = serializers.FloatField(allow_null=True)
    days = serializers.ListField(child=serializers.DateField())
    series = serializers.DictField(
        child=serializers.ListField(child=serializers.FloatField())
    )
    top_jobs = TopJobOut(many=True, help_text="The 10 jobs that used most.")
    lost_gpu_hours = serializers.FloatField(
        help_text="Work lost to preemption: the run of preempted or requeued"
        " attempts after their last checkpoint, charged to nobody's quota and"
        " not in gpu_hours."
    )
    lost_jobs = TopJobOut(
        many=True, help_text="The 10 jobs that lost most (GPU-hours lost)."
    )
    quotas = QuotaOut(many=True)


def _usage_to() -> str:
    return (
        "Last UTC day (default: today). The range, both ends included, spans at"
        f" most {settings.GPULAB_USAGE_MAX_DAYS} days (GPULAB_USAGE_MAX_DAYS): a"
        " longer one is a 400 naming `to`."
    )


# Read when the schema is built: the limit the server applies now.
_USAGE_TO = lazy(_usage_to, str)()


class Usage(APIView):
    @extend_schema(
        operation_id="usage",
        parameters=[
            UsageQuery,
            OpenApiParameter(
                "from", date, description="First UTC day (default: 29 days ago)."
            ),
            OpenApiParameter("to", date, description=_USAGE_TO),
        ],
        responses={200: UsageOut, **errors(400, 403)},
        summary="GPU-hours per day (yours, or a group's for its leaders and staff)"
        " and the quotas that apply",
    )
    def get(self, request: Request) -> Response:
        no_empty(request)
        today = timezone.now().astimezone(UTC).date()
        form = RangeForm(request.query_params, today)
        if not form.is_valid():
            raise serializers.ValidationError(
                {
                    ("range" if k == "__all__" else k): [str(e) for e in v]
                    for k, v in form.errors.items()
                }
            )
        # the Usage page's rule: a group's usage for its leaders and staff only
        scope, group = _scope_for(cast("Any", request), form.cleaned_data["group"])
        report = reports.report(
            scope, form.cleaned_data["from"], form.cleaned_data["to"], timezone.now()
        )
        quotas = quota_states(
            quotas=Quota.objects.filter(group=group).select_related("group", "user")
            if group is not None
            else Quota.objects.for_user(request.user)
        )
        return Response(
            UsageOut(
                {
                    "first": report.first,
                    "last": report.last,
                    "scope": f"group {group.name}"
                    if group is not None
                    else f"user {request.user.get_username()}",
                    "gpu_hours": report.gpu_hours,
                    "running_gpu_hours": report.running_gpu_hours,
                    "energy_kwh": report.energy_kwh,
                    "efficiency": report.efficiency,
                    "days": report.days,
                    "series": report.series,
                    "top_jobs": report.top_jobs,
                    "lost_gpu_hours": report.lost_gpu_hours,
                    "lost_jobs": report.lost_jobs,
                    "quotas": [
                        {
                            "scope": q.view().label,
                            "hard": q.quota.hard,
                            "period": q.quota.period_label,
                            "period_start": q.period_start,
                            "period_end": q.period_end,
                            "gpu_hours": q.limit_gpu_hours,
                            "used_gpu_hours": q.used_gpu_hours,
                            "percent": q.percent,
                            "max_gpus": q.quota.max_gpus,
                            "running_gpus": q.running_gpus,
                            "exhausted": q.exhausted,
                        }
                        for q in quotas
                    ],
                }
            ).data
        )


class MeOut(serializers.Serializer[Any]):
    username = serializers.CharField()
    staff = serializers.BooleanField()
    groups = serializers.ListField(child=serializers.CharField())
    token = serializers.CharField(
        allow_null=True, help_text="The name of the token used, if any."
    )
    token_expires_at = serializers.DateTimeField(allow_null=True)


class Me(APIView):
    @extend_schema(
        operation_id="me",
        responses={200: MeOut, **errors()},
        summary="Who the token (or session) is",
    )
    def get(self, request: Request) -> Response:
        from portal.api.models import ApiToken

        user = request.user
        token = request.auth if isinstance(request.auth, ApiToken) else None
        return Response(
            MeOut(
                {
                    "username": user.get_username(),
                    "staff": user.is_staff,
                    "groups": [g.name for g in services.groups_of(user)],  # type: ignore[arg-type]
                    "token": token.name if token else None,
                    "token_expires_at": token.expires_at if token else None,
                }
            ).data
        )
