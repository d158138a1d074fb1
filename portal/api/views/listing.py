"""The job list's items written from rows, not models.

A page of 1,000 jobs read as models cost the web process about half a
millisecond of Python per job (bench/job_page_cost.py): a ``Job`` and its
owner's, group's and holder's ``User`` / ``Group`` built field by field, its
attempts and dependencies as models too, then each of the item's 44 fields
read back from them. Under the GIL that time is taken from every other request
the process serves (issue #27: another user's calls beside a member's biggest
pages). Here the page's jobs, their attempts and their dependencies are read as
tuples (``values_list``: the same three queries) and each item is written
straight from them, field by field in ``serializers.JobSerializer``'s order
and by its fields' own rules: a plain field's value from its source's column
(``owner.username`` is ``owner__username``), converted as the field's
``to_representation`` would (``str``, ``int``, a time in ISO 8601 in the
current time zone, ...), and the method fields by the functions the serializer
itself calls (``restarts_of``, ``expected_end_text``, ``node_names_of``,
``queue_places``). The detail and every other answer still go through the
serializer; ``tests/api/test_job_list_cost.py`` holds the two equal, key by
key and in order."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from django.db import connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL
from rest_framework import ISO_8601
from rest_framework import serializers as drf
from rest_framework.settings import api_settings

from portal.api import serializers as s
from portal.api.views.common import ATTEMPT_COLUMNS, node_names, page_of
from scheduler.models import Attempt, Job, JobDependency, queue_places, restarts_of

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime, tzinfo

    from django.db.models import Model, QuerySet

# JobSerializer's fields written from more than their own column, and the
# columns those read besides the plain fields' own.
JOB_COMPUTED = (
    "interactive_url",
    "restarts",
    "lost_work_gpu_s",
    "guest",
    "queue_position",
    "cancel_requested",
    "held_by",
    "nodes",
    "dependencies",
    "expected_end",
)
JOB_EXTRA = ("queue_order", "preemptions", "cancel_requested_at", "held_by__username")
_NUMBER, _NODE, _RANKS, _STARTED, _ENDED, _LOST, _GUEST = (
    ATTEMPT_COLUMNS.index(c)
    for c in (
        "number", "node_id", "ranks", "started_at", "ended_at", "lost_work_gpu_s",
        "guest",
    )
)  # fmt: skip
_MOMENT = "moment"  # (_MOMENT, field): a time, written in the request's zone


def _writer(field: drf.Field[Any, Any, Any, Any]) -> Any:
    """How a plain field writes a value that is not None: a builtin where the
    field's ``to_representation`` is that builtin, else the field's own."""
    kind = type(field)
    if kind is drf.CharField:
        return str
    if kind is drf.IntegerField:
        return int
    if kind is drf.FloatField:
        return float
    if kind is drf.BooleanField:
        # DRF's TRUE_VALUES / FALSE_VALUES hold True and False: a column's bool
        # is written as itself; anything else goes to the field
        return lambda value: (
            value if type(value) is bool else field.to_representation(value)
        )
    if kind is drf.DictField and type(field.child) is drf.CharField:  # type: ignore[attr-defined]
        return lambda value: {
            str(k): None if v is None else str(v) for k, v in value.items()
        }
    if (
        kind is drf.DateTimeField
        and not hasattr(field, "timezone")
        and getattr(field, "format", api_settings.DATETIME_FORMAT) == ISO_8601
    ):
        return (_MOMENT, field)
    return field.to_representation


@cache
def _plan(
    serializer: type[drf.Serializer[Any]], computed: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[tuple[str, int, Any], ...]]:
    """The columns ``serializer``'s plain fields read, and per field of an item
    in order: its name, its column's index (-1: one of ``computed``) and its
    writer."""
    columns: list[str] = []
    plan: list[tuple[str, int, Any]] = []
    for name, field in serializer().fields.items():
        if name in computed:
            plan.append((name, -1, None))
            continue
        plan.append((name, len(columns), _writer(field)))
        columns.append("__".join(field.source_attrs))
    return tuple(columns), tuple(plan)


def _items(
    rows: list[tuple[Any, ...]],
    plan: tuple[tuple[str, int, Any], ...],
    computed: dict[str, Callable[[tuple[Any, ...]], Any]],
) -> list[dict[str, Any]]:
    """Each row written as an item by ``plan``: a plain field's column by its
    writer (None as None), a computed one by its function of the row."""
    tz: Any = drf.DateTimeField().default_timezone()  # the request's
    writers: list[tuple[str, int, Any]] = []
    for name, index, write in plan:
        if index < 0:
            writers.append((name, index, computed[name]))
        elif type(write) is tuple:  # (_MOMENT, its field)
            field = write[1]
            plain = _times(tz, field) if tz is not None else field.to_representation
            writers.append((name, index, plain))
        else:
            writers.append((name, index, write))
    items = []
    for row in rows:
        item: dict[str, Any] = {}
        for name, index, write in writers:
            if index < 0:
                item[name] = write(row)
            else:
                value = row[index]
                item[name] = None if value is None else write(value)
        items.append(item)
    return items


def _attempts(ids: list[int]) -> dict[int, list[tuple[Any, ...]]]:
    """The jobs' attempts as ``ATTEMPT_COLUMNS`` rows, by job, in number order."""
    attempts: dict[int, list[tuple[Any, ...]]] = {}
    for attempt in (
        Attempt.objects.filter(_job_among(Attempt, ids))
        .order_by("job_id", "number")
        .values_list(*ATTEMPT_COLUMNS)
    ):
        attempts.setdefault(attempt[0], []).append(attempt)
    return attempts


def _job_among(model: type[Model], ids: list[int]) -> RawSQL:
    """``model``'s ``job_id = ANY(ids)``: the ids as one array parameter, where
    ``job_id__in`` sends one placeholder per job, which psycopg splits the query
    at (a few ms for a page of 1,000 jobs: ``bench/job_page_cost.py``)."""
    quote = connection.ops.quote_name
    column = f"{quote(model._meta.db_table)}.{quote('job_id')}"
    return RawSQL(f"{column} = ANY(%s)", [ids], output_field=BooleanField())


def _nodes(tried: list[tuple[Any, ...]] | None, names: dict[int, str]) -> list[str]:
    """``serializers.latest_nodes`` on attempt rows (None: never started)."""
    if not tried:
        return []
    last = max(tried, key=lambda a: a[_NUMBER])
    return s.node_names_of([int(n) for n in last[_RANKS]] or [last[_NODE]], names)


def _attempt(row: tuple[Any, ...]) -> Attempt:
    """An attempt row as the model (for the rules that take one)."""
    return Attempt(**dict(zip(ATTEMPT_COLUMNS, row, strict=True)))


def _times(tz: tzinfo, field: Any) -> Callable[[datetime], Any]:
    """A time as ``DateTimeField.to_representation`` writes it in ``tz``:
    ISO 8601, UTC as Z; what it would refuse or convert otherwise (a naive time,
    one out of range in ``tz``) is left to the field."""

    def write(value: datetime) -> Any:
        if value.tzinfo is None:
            return field.to_representation(value)
        try:
            text = value.astimezone(tz).isoformat()
        except OverflowError:
            return field.to_representation(value)
        return text[:-6] + "Z" if text.endswith("+00:00") else text

    return write


def job_items(ordered: QuerySet[Job], offset: int, limit: int) -> list[dict[str, Any]]:
    """``ordered[offset : offset + limit]`` (``page_of``) as the job list's
    items: what ``JobSerializer(many=True)`` writes for those jobs read by
    ``views.common.listed``, in three queries (the jobs with their owner's,
    group's and holder's names, their attempts, their dependencies), plus the
    node names and the waiting jobs' places in the queue."""
    own, plan = _plan(s.JobSerializer, JOB_COMPUTED)
    columns = (*own, *JOB_EXTRA)
    rows = page_of(ordered, offset, limit, Job.objects.values_list(*columns))
    if not rows:
        return []
    at = {c: i for i, c in enumerate(columns)}
    i_id, i_status, i_interactive = at["id"], at["status"], at["interactive"]
    i_attempts, i_preemptions = at["attempts"], at["preemptions"]
    i_cancel, i_holder = at["cancel_requested_at"], at["held_by__username"]
    ids = [row[i_id] for row in rows]
    attempts = _attempts(ids)
    dependencies: dict[int, list[dict[str, Any]]] = {}
    for job_id, kind, on, state in (
        JobDependency.objects.filter(_job_among(JobDependency, ids))
        .order_by("depends_on_id")
        .values_list("job_id", "kind", "depends_on_id", "depends_on__status")
    ):
        # DependencyOut's fields: type, job, state
        dependencies.setdefault(job_id, []).append(
            {"type": str(kind), "job": int(on), "state": str(state)}
        )
    pending = Job.Status.PENDING
    i_order, i_submitted = at["queue_order"], at["submitted_at"]
    places = queue_places(
        [
            (row[i_id], row[i_order], row[i_submitted])
            for row in rows
            if row[i_status] == pending and row[i_order] is not None
        ]
    )
    names = node_names()

    def restarts(row: tuple[Any, ...]) -> tuple[int, int]:
        if not row[i_preemptions] and row[i_attempts] < 2:
            return 0, 0
        return restarts_of(
            (a[_NUMBER], a[_STARTED], a[_LOST]) for a in attempts.get(row[i_id], [])
        )

    def guest(row: tuple[Any, ...]) -> bool:
        if row[i_status] != Job.Status.RUNNING:
            return False
        return any(a[_GUEST] for a in attempts.get(row[i_id], []) if a[_ENDED] is None)

    def expected_end(row: tuple[Any, ...]) -> str | None:
        if row[i_status] != Job.Status.RUNNING:
            return None
        job = Job(**{c: row[at[c]] for c in ("id", "status", *_PLANS_WITH)})
        tried = [_attempt(a) for a in attempts.get(row[i_id], [])]
        return s.expected_end_text(job, tried)

    return _items(
        rows,
        plan,
        {
            "interactive_url": lambda row: s.interactive_url(
                row[i_id], row[i_interactive]
            ),
            "restarts": lambda row: restarts(row)[0],
            "lost_work_gpu_s": lambda row: restarts(row)[1],
            "guest": guest,
            "queue_position": lambda row: places.get(row[i_id]),
            "cancel_requested": lambda row: row[i_cancel] is not None,
            "held_by": lambda row: row[i_holder],
            "nodes": lambda row: _nodes(
                attempts.get(row[i_id]) if row[i_attempts] else None, names
            ),
            "dependencies": lambda row: dependencies.get(row[i_id], []),
            "expected_end": expected_end,
        },
    )


# The job's fields ``portal.expected_end.of`` reads besides its state.
_PLANS_WITH = ("time_limit_s", "predicted_runtime_s")
