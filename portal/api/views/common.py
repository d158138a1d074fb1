"""Helpers every API view shares: the errors each operation documents, query
parsing, the visible job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.postgres.expressions import ArraySubquery
from django.db.models import F, Lookup, Prefetch
from django.http import Http404
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

from portal.api.serializers import ErrorSerializer
from scheduler.models import Attempt, Job, JobDependency, Node

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from rest_framework.request import Request

_ERRORS = {
    400: "Invalid input (see fields).",
    401: "Not authenticated: no token, or a bad, expired or revoked one.",
    403: "Not allowed.",
    404: "Not found (or not visible to you).",
    405: "Method not allowed.",
    409: "The job's state does not allow it.",
    413: "Request body too large.",
    415: "Unsupported media type (send JSON).",
    429: "Rate limited; see Retry-After.",
}


def errors(*codes: int) -> dict[int, OpenApiResponse]:
    """The error responses an operation documents (401 and 429 always)."""
    wanted = sorted({401, 429, *codes})
    return {c: OpenApiResponse(ErrorSerializer, description=_ERRORS[c]) for c in wanted}


def query(serializer: type[serializers.Serializer[Any]], request: Request) -> Any:
    """Parse query parameters; a 400 naming each bad one."""
    no_empty(request)
    parsed = serializer(data=request.query_params)
    parsed.is_valid(raise_exception=True)
    return parsed.validated_data


def no_empty(request: Request) -> None:
    """``?until=`` is a mistake, not "no limit": name it (400)."""
    empty = {
        k: ["Give a value or leave the parameter out."]
        for k, v in request.query_params.items()
        if v == ""
    }
    if empty:
        raise serializers.ValidationError(empty)


# Job fields no answer of the API reads: left in the database.
UNREAD_JOB_FIELDS = ("priority_breakdown", "interactive_token", "last_preempted_at")


def jobs_for(request: Request) -> Any:
    """The jobs the requester may see, read as ``listed`` reads them."""
    return listed(Job.objects.visible_to(request.user))


def listed(jobs: QuerySet[Job]) -> Any:
    """``jobs`` with what the serializer reads and no more: the owner's,
    group's and holder's names joined in, the attempts and dependencies in one
    query each for a whole page (as lists, ``to_attr``: a related manager's
    queryset per job would cost more than the rows)."""
    return (
        jobs.select_related("owner", "group", "held_by")
        .defer(*UNREAD_JOB_FIELDS)
        .prefetch_related(dependencies_out(), attempts_for_nodes())
    )


def page_of(ordered: QuerySet[Job], offset: int, limit: int, read: Any) -> list[Any]:
    """``ordered[offset : offset + limit]``, each job read as the queryset
    ``read`` reads it (its joins, deferred fields and prefetches; or its
    ``values_list`` rows), in one query whose page is chosen first as ids:
    ``id = ANY(ARRAY(ids))``, the ids' LIMIT/OFFSET query run once (an init
    plan), then the page's jobs by their primary key. PostgreSQL thus sorts and skips ``offset`` narrow rows
    instead of ``offset`` whole jobs joined to their owner, group and holder,
    which made a deep page (``offset=10000``) cost several times a first one
    (bench/bounded_cost.py); ``id IN (subquery)`` would let it plan a hash
    semi-join over every job instead. ``ordered``'s ordering must end in the
    id, so the page is the same whichever rows tie on the keys before it."""
    keys = ordered.query.order_by
    last = keys[-1] if keys else None
    if not isinstance(last, str) or last.lstrip("-") not in ("id", "pk"):
        raise ValueError(f"the ordering {keys!r} must end in the id")
    if limit <= 0:
        return []
    ids = ordered.values("pk")[offset : offset + limit]
    return list(read.filter(AnyOf(F("pk"), ArraySubquery(ids))).order_by(*keys))


class AnyOf(Lookup[Any]):
    """``lhs = ANY(rhs)``, ``rhs`` an array (``ArraySubquery``)."""

    lookup_name = "any_of"

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        return f"{lhs} = ANY({rhs})", [*lhs_params, *rhs_params]


def dependencies_out() -> Prefetch[Any, Any]:
    """A job's dependencies as ``serializers.DependencyOut`` reads them, with the
    state of the job each waits for, in ``dependency_list``."""
    return Prefetch(
        "dependencies",
        queryset=JobDependency.objects.annotate(
            depends_on_state=F("depends_on__status")
        )
        .only("id", "job_id", "depends_on_id", "kind")
        .order_by("depends_on_id"),
        to_attr="dependency_list",
    )


# An attempt's columns that ``serializers.latest_nodes``, ``Job.restarts``, the
# guest mark and the expected end (``portal.expected_end.of``) read, by their
# attribute names: what the list's rows (``views.listing``) and
# ``attempts_for_nodes`` load.
ATTEMPT_COLUMNS = (
    "job_id",
    "number",
    "node_id",
    "ranks",
    "created_at",
    "started_at",
    "ended_at",
    "progress_step",
    "progress_total",
    "progress_at",
    "progress_first_step",
    "progress_first_at",
    "lost_work_gpu_s",
    "guest",
)


def attempts_for_nodes() -> Prefetch[Any, Any]:
    """The attempts' fields ``serializers.latest_nodes``, ``JobSerializer``'s
    expected end and ``Job.restarts`` read, in ``attempt_list``."""
    return Prefetch(
        "attempt_set",
        queryset=Attempt.objects.only(
            "id",
            *ATTEMPT_COLUMNS,
            # ``portal.preemption``: a running job chosen as a preemption's victim
            "kill_reason",
            "kill_sent_at",
            "preempted_for",
        ).order_by("number"),
        to_attr="attempt_list",
    )


def visible_job(request: Request, job_id: int) -> Job:
    """The job if the requester may see it; 404 otherwise (no existence leak)."""
    job: Job | None = jobs_for(request).filter(pk=job_id).first()
    if job is None:
        raise Http404(f"No job {job_id} visible to you.")
    return job


def node_names() -> dict[int, str]:
    return dict(Node.objects.values_list("pk", "name"))
