"""Jobs and job arrays: submit, list, detail, cancel, hold / release, requeue,
logs, events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import (
    Count,
    F,
    Func,
    IntegerField,
    Q,
    RowRange,
    Sum,
    Window,
    prefetch_related_objects,
)
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api import serializers as s
from portal.api.views.common import (
    dependencies_out,
    errors,
    jobs_for,
    node_names,
    query,
    visible_job,
)
from portal.api.views.listing import job_items
from scheduler import services
from scheduler.models import Attempt, Job, JobArray, JobLogChunk

if TYPE_CHECKING:
    from rest_framework.request import Request


def _interactive_refusals(data: dict[str, Any], given: object) -> dict[str, list[str]]:
    """The fields of an interactive submission that gpulab sets itself (and
    the schema forbids with ``interactive``): each one ``given`` is refused."""
    kind = data["interactive"]
    names = set(given) if isinstance(given, Mapping) else set()
    return {
        name: [f"Not for an interactive job ({kind}): gpulab sets it."]
        for name in s.INTERACTIVE_SETS
        if name in names
    }


def _request(data: dict[str, Any]) -> services.JobRequest:
    if data.get("interactive"):
        return services.interactive_request(
            data["interactive"],
            gpus=data["gpus"],
            gpu_memory_mib=data["gpu_memory_mib"],
            time_limit_s=data["time_limit_s"],
            shareable=data["shareable"],
            group=data["group"],
            workdir=data["workdir"],
            name=data.get("name") or "",
        )
    return services.JobRequest(
        name=data.get("name", ""),
        command=data.get("command", ""),
        workdir=data["workdir"],
        env=data["env"],
        gpus=data["gpus"],
        gpu_memory_mib=data["gpu_memory_mib"],
        time_limit_s=data["time_limit_s"],
        priority_class=data["priority_class"],
        shareable=data["shareable"],
        workload=data["workload"],
        group=data["group"],
        kill_grace_s=data["kill_grace_s"],
        requeue_on_node_loss=data["requeue_on_node_loss"],
        gpu_model=data["gpu_model"],
        slowdown_cap=data["slowdown_cap"],
        evictable=data["evictable"],
        after=data["after"],
        checkpointable=data["checkpointable"],
        checkpoint_signal=data["checkpoint_signal"],
        checkpoint_grace_s=data["checkpoint_grace_s"],
    )


def _submission(
    request: Request, serializer: type[s.JobRequestSerializer]
) -> dict[str, Any]:
    """The typed fields of a job (or array) submission, or a 400 naming every bad
    field at once: when some fields have the wrong type, those that parsed are
    still checked by the services' rules (the form's and the CLI's), so a client
    does not learn of a second problem only after fixing the first."""
    parsed = serializer(data=request.data)
    if parsed.is_valid():
        valid = dict(parsed.validated_data)
        kind = valid.get("interactive")
        wrong = _interactive_refusals(valid, request.data) if kind else {}
        if wrong:
            raise exceptions.ValidationError(wrong)
        return valid
    wrong = dict(parsed.errors)
    if not isinstance(request.data, Mapping) or "non_field_errors" in wrong:
        raise exceptions.ValidationError(wrong)
    typed = {
        name: field.run_validation(field.get_value(request.data))
        for name, field in parsed.fields.items()
        if name not in wrong
    }
    if typed.get("interactive"):
        for name, messages in _interactive_refusals(typed, request.data).items():
            wrong.setdefault(name, messages)
    try:
        services.validated_submission(
            request.user,  # type: ignore[arg-type]
            _request(_PLACEHOLDERS | typed),
        )
    except DjangoValidationError as exc:
        for name, messages in exc.message_dict.items():
            wrong.setdefault(name, messages)
    if "array" in typed:
        try:
            services.parse_array_spec(typed["array"])
        except DjangoValidationError as exc:
            wrong.setdefault("array", exc.messages)
    raise exceptions.ValidationError(wrong)


# What a field with the wrong type stands in for while the others are checked
# (its own error is the serializer's; the service's word on it is dropped): the
# request's own defaults, and a harmless name and command.
_PLACEHOLDERS: dict[str, Any] = {
    f.name: f.default for f in fields(services.JobRequest) if f.default is not MISSING
} | {"name": "job", "command": "true"}


def _job_response(request: Request, job_id: int, code: int = 200) -> Response:
    job = visible_job(request, job_id)
    context = {"node_names": node_names()}
    return Response(s.JobSerializer(job, context=context).data, status=code)


class JobList(APIView):
    @extend_schema(
        operation_id="jobs_list",
        parameters=[s.JobListQuery, s.STATE_PARAMETER],
        responses={200: s.JobPageSerializer, **errors(400)},
        summary="Jobs you may see (yours; staff: everyone's), newest first",
    )
    def get(self, request: Request) -> Response:
        q = query(s.JobListQuery, request)
        jobs = jobs_for(request)
        if q.get("state"):
            jobs = jobs.filter(status__in=q["state"])
        if q.get("owner"):
            jobs = jobs.filter(owner__username=q["owner"])
        if q.get("group"):
            jobs = jobs.filter(group__name=q["group"])
        if q.get("node"):
            jobs = jobs.filter(
                pk__in=Attempt.objects.filter(Q(node__name=q["node"])).values("job_id")
            )
        if q.get("array"):
            jobs = jobs.filter(array_id=q["array"])
        if q.get("since"):
            jobs = jobs.filter(
                Q(finished_at__isnull=True) | Q(finished_at__gte=q["since"])
            )
        if q.get("until"):
            jobs = jobs.filter(submitted_at__lt=q["until"])
        if q.get("before"):
            jobs = jobs.filter(pk__lt=q["before"])
        jobs = jobs.order_by("-id")
        count = jobs.count()
        limit, offset = q["limit"], q["offset"]
        items = job_items(jobs, offset, limit)

        def link(at: int, before: int | None = None) -> str:
            params = request.query_params.copy()
            params["offset"] = str(at)
            params["limit"] = str(limit)
            if before is not None:
                params["before"] = str(before)
            return request.build_absolute_uri(f"{request.path}?{params.urlencode()}")

        following = None
        if offset + limit < count:
            # From a cursor, the next page is the next cursor (an offset would
            # make each page cost more than the one before it).
            following = (
                link(0, items[-1]["id"]) if "before" in q else link(offset + limit)
            )
        data = {
            "count": count,
            "next": following,
            "previous": link(max(0, offset - limit)) if offset > 0 else None,
            # JobSerializer's items, written from rows (``listing``)
            "results": items,
        }
        return Response(data)

    @extend_schema(
        operation_id="jobs_submit",
        request=s.JobRequestSerializer,
        responses={201: s.JobSerializer, **errors(400, 413, 415)},
        summary="Submit a job",
    )
    def post(self, request: Request) -> Response:
        data = _submission(request, s.JobRequestSerializer)
        job = services.submit_job(request.user, _request(data))  # type: ignore[arg-type]
        # Answered from the row just stored (its owner, group and dependencies
        # are at hand; no attempt yet): reading it again through the visibility
        # filter would cost as much as the submission (bench/submit_burst.py).
        prefetch_related_objects([job], dependencies_out())
        return Response(s.JobSerializer(job).data, status=status.HTTP_201_CREATED)


class JobDetail(APIView):
    @extend_schema(
        operation_id="jobs_detail",
        responses={200: s.JobSerializer, **errors(404)},
        summary="One job",
    )
    def get(self, request: Request, job_id: int) -> Response:
        return _job_response(request, job_id)


class JobVerb(APIView):
    """POST on a job: one service verb, the job back (409 in the wrong state)."""

    verb: str = ""

    def post(self, request: Request, job_id: int) -> Response:
        job = visible_job(request, job_id)
        user = request.user
        if self.verb == "cancel":
            services.cancel_job(job.pk, by=user)  # type: ignore[arg-type]
        elif self.verb == "hold":
            services.hold_job(job.pk, by=user)  # type: ignore[arg-type]
        elif self.verb == "release":
            services.release_job(job.pk, by=user)  # type: ignore[arg-type]
        elif self.verb == "requeue":
            # requeue_job checks the admin console's permission (requeue_job)
            services.requeue_job(job.pk, by=user)  # type: ignore[arg-type]
        return _job_response(request, job.pk)


def _verb(name: str, summary: str, codes: tuple[int, ...]) -> type[JobVerb]:
    @extend_schema(
        operation_id=f"jobs_{name}",
        request=None,
        responses={200: s.JobSerializer, **errors(*codes)},
        summary=summary,
    )
    def post(self: JobVerb, request: Request, job_id: int) -> Response:
        return JobVerb.post(self, request, job_id)

    return type(f"Job{name.title()}", (JobVerb,), {"verb": name, "post": post})


JobCancel = _verb(
    "cancel",
    "Cancel a job (yours; admins with cancel_any_job: any). A waiting one ends at once; a running one is stopped",
    (403, 404, 409),
)
JobHold = _verb("hold", "Hold a pending job (yours; admins: any)", (403, 404, 409))
JobRelease = _verb(
    "release", "Release a held job (your own hold; admins: any)", (403, 404, 409)
)
JobRequeue = _verb(
    "requeue", "Requeue a running job (admins with requeue_job)", (403, 404, 409)
)


class JobEvents(APIView):
    @extend_schema(
        operation_id="jobs_events",
        responses={200: s.EventSerializer(many=True), **errors(404)},
        summary="A job's history, oldest first (the latest"
        f" {settings.GPULAB_JOB_EVENTS_MAX}, GPULAB_JOB_EVENTS_MAX)",
    )
    def get(self, request: Request, job_id: int) -> Response:
        job = visible_job(request, job_id)
        limit = settings.GPULAB_JOB_EVENTS_MAX
        events = list(job.events.select_related("actor").order_by("-at", "-id")[:limit])
        events.reverse()
        return Response(s.EventSerializer(events, many=True).data)  # type: ignore[arg-type]


_BYTES = Func(F("data"), function="octet_length", output_field=IntegerField())


class JobLogs(APIView):
    @extend_schema(
        operation_id="jobs_logs",
        parameters=[s.LogQuery],
        responses={200: s.LogSerializer, **errors(400, 404)},
        summary="A job's output: from a byte offset (to follow it) or its tail",
    )
    def get(self, request: Request, job_id: int) -> Response:
        """Output of one rank of one attempt (default: rank 0 of the latest), by
        the agent's byte offsets: ``offset`` returns what follows it (up to
        ``limit`` bytes) and ``next_offset`` to ask from next time, so following
        a job costs one indexed query per poll; ``tail`` the last bytes."""
        q = query(s.LogQuery, request)
        job = visible_job(request, job_id)
        attempts = Attempt.objects.filter(job=job).order_by("-number")
        attempt = (
            attempts.filter(number=q["attempt"]).first()
            if "attempt" in q
            else attempts.first()
        )
        if attempt is None:
            if "attempt" in q:
                raise Http404(f"Job {job.pk} has no attempt {q['attempt']}.")
            return Response(
                s.LogSerializer(
                    {
                        "job": job.pk,
                        "attempt": None,
                        "rank": q["rank"],
                        "node": None,
                        "offset": 0,
                        "next_offset": 0,
                        "data": "",
                        "complete": job.is_terminal,
                    }
                ).data
            )
        ranks = attempt.node_ids
        if q["rank"] >= len(ranks):
            raise Http404(f"Attempt {attempt.number} has {len(ranks)} rank(s).")
        node_id = ranks[q["rank"]]
        # single-node attempts of before per-node logs stored no node
        chunks = JobLogChunk.objects.filter(attempt=attempt).filter(
            Q(node_id=node_id) | Q(node__isnull=True)
        )
        limit = q["limit"]
        parts: list[bytes] = []
        if "tail" in q:
            want = min(q["tail"], limit)
            # Only the last chunks that hold ``want`` bytes leave PostgreSQL: a
            # running sum of the sizes from the end (the whole log of a job
            # may be many MiB: GPULAB_LOG_MAX_BYTES).
            rows = [
                (off, data.encode())
                for off, data in chunks.annotate(
                    n=_BYTES,
                    after=Window(
                        Sum(_BYTES),
                        order_by=F("offset").desc(),
                        frame=RowRange(start=None, end=0),
                    ),
                )
                .filter(after__lt=want + F("n"))
                .order_by("offset")
                .values_list("offset", "data")
            ]
            end = rows[-1][0] + len(rows[-1][1]) if rows else 0
            joined = b"".join(r for _, r in rows)
            cut = max(0, len(joined) - want)
            parts = [joined[cut:]]
            start = end - len(parts[0]) if rows else 0
        else:
            start = q.get("offset", 0)
            end = start
            size = 0
            rows_q = (
                chunks.annotate(n=_BYTES)
                .filter(offset__gte=start - F("n") + 1)
                .order_by("offset")
                .values_list("offset", "data")
            )
            for off, data in rows_q[:1000]:
                raw = data.encode()
                if off < start:
                    raw = raw[start - off :]
                    off = start
                elif off > end and not parts:
                    start = end = off  # a gap (the log cap): skip to what is stored
                if size and size + len(raw) > limit:
                    break
                parts.append(raw[: limit - size])
                size += len(parts[-1])
                end = off + len(parts[-1])
                if size >= limit:
                    break
        text = b"".join(parts).decode("utf-8", "replace")
        complete = (
            attempt.ended_at is not None and not chunks.filter(offset__gte=end).exists()
        )
        name = node_names().get(node_id)
        return Response(
            s.LogSerializer(
                {
                    "job": job.pk,
                    "attempt": attempt.number,
                    "rank": q["rank"],
                    "node": name,
                    "offset": start,
                    "next_offset": end,
                    "data": text,
                    "complete": complete,
                }
            ).data
        )


# ------------------------------------------------------------------ arrays


def _array_data(array: JobArray) -> dict[str, Any]:
    tasks = list(array.tasks.order_by("array_index"))
    counts = {
        row["status"]: row["n"]
        for row in array.tasks.values("status").annotate(n=Count("id")).order_by()
    }
    return {
        "id": array.pk,
        "name": array.name,
        "owner": array.owner,
        "spec": array.spec,
        "size": array.size,
        "max_running": array.max_running,
        "created_at": array.created_at,
        "counts": counts,
        "tasks": tasks,
    }


def _visible_array(request: Request, array_id: int) -> JobArray:
    """An array is visible when its tasks are (the same rule as jobs)."""
    if not Job.objects.visible_to(request.user).filter(array_id=array_id).exists():
        raise Http404(f"No array {array_id} visible to you.")
    return JobArray.objects.select_related("owner").get(pk=array_id)


class ArrayList(APIView):
    @extend_schema(
        operation_id="arrays_submit",
        request=s.ArrayRequestSerializer,
        responses={201: s.ArraySerializer, **errors(400, 413, 415)},
        summary="Submit a job array: one job per index, at most %N running at once",
    )
    def post(self, request: Request) -> Response:
        data = _submission(request, s.ArrayRequestSerializer)
        array = services.submit_array(request.user, _request(data), data["array"])  # type: ignore[arg-type]
        array = JobArray.objects.select_related("owner").get(pk=array.pk)
        return Response(s.ArraySerializer(_array_data(array)).data, status=201)


class ArrayDetail(APIView):
    @extend_schema(
        operation_id="arrays_detail",
        responses={200: s.ArraySerializer, **errors(404)},
        summary="A job array with each task's state",
    )
    def get(self, request: Request, array_id: int) -> Response:
        array = _visible_array(request, array_id)
        return Response(s.ArraySerializer(_array_data(array)).data)


class ArrayCancel(APIView):
    @extend_schema(
        operation_id="arrays_cancel",
        request=None,
        responses={200: s.CancelledSerializer, **errors(403, 404)},
        summary="Cancel every task of an array still waiting or running (yours; admins with cancel_any_job: any)",
    )
    def post(self, request: Request, array_id: int) -> Response:
        array = _visible_array(request, array_id)
        cancelled = services.cancel_array(array.pk, by=request.user)  # type: ignore[arg-type]
        return Response({"cancelled": cancelled})
