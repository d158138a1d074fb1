"""What the API reads and writes. Input serializers only parse JSON into typed
values (like the submit form parses text): every rule about a job lives in
``scheduler.services`` and comes back as a field-keyed 400. Output serializers
are read-only views of the rows."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils import timezone
from rest_framework import serializers

from portal import expected_end
from scheduler.models import Job, JobDependency, JobEvent

MAX_INT = 2**31 - 1
STATES = [s.value for s in Job.Status]


class Text(serializers.CharField):
    """A string that PostgreSQL can store: no NUL (DRF's default validator) and
    no lone surrogate (JSON allows ``"\\ud800"``; UTF-8 does not)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_blank", True)
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            raise serializers.ValidationError("Must be a string.")
        value = super().to_internal_value(data)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise serializers.ValidationError("Must be valid UTF-8 text.") from None
        return value


class StrictBool(serializers.BooleanField):
    """A JSON true or false only: "false" or 0 read as a bool would turn a
    client's mistake into a setting it did not ask for."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            raise serializers.ValidationError("Must be true or false.")
        return data


class Moment(serializers.DateTimeField):
    """An ISO 8601 time Python can hold in UTC as in the server's time zone: at
    the calendar's ends (``0001-01-01T00:00`` read in a zone east of UTC) the
    conversion leaves years 1 to 9999, a 400 naming the field, not a 500."""

    def to_internal_value(self, value: Any) -> Any:
        try:
            return super().to_internal_value(value)
        except OverflowError:
            raise serializers.ValidationError(
                "Out of range: the time falls outside years 1 to 9999 in UTC or in"
                " the server's time zone."
            ) from None


# ------------------------------------------------------------------ errors


class ErrorSerializer(serializers.Serializer[Any]):
    """Every error: a code, a sentence, and the fields at fault."""

    error = serializers.CharField(help_text="invalid, not_found, wrong_state, ...")
    detail = serializers.CharField()
    fields = serializers.DictField(  # type: ignore[assignment]
        child=serializers.ListField(child=serializers.CharField()),
        help_text="Field name -> messages (400 only; empty otherwise).",
    )


# ------------------------------------------------------------------ jobs in


class JobRequestSerializer(serializers.Serializer[Any]):
    """A job to submit (``services.JobRequest``)."""

    name = Text(max_length=10_000)
    command = Text(max_length=200_000)
    workdir = Text(required=False, default="", max_length=10_000)
    env = serializers.DictField(
        child=Text(max_length=100_000), required=False, default=dict
    )
    gpus = serializers.IntegerField(
        required=False, default=1, min_value=-MAX_INT, max_value=MAX_INT
    )
    gpu_memory_mib = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=-MAX_INT,
        max_value=MAX_INT,
    )
    gpu_model = Text(required=False, default="", max_length=10_000)
    time_limit_s = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=-MAX_INT,
        max_value=MAX_INT,
    )
    priority_class = Text(required=False, default="", max_length=1000)
    shareable = serializers.BooleanField(required=False, default=False)
    slowdown_cap = serializers.FloatField(required=False, allow_null=True, default=None)
    evictable = serializers.BooleanField(required=False, default=True)
    workload = Text(required=False, default="", max_length=10_000)
    group = Text(required=False, default="", max_length=1000)
    kill_grace_s = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=-MAX_INT,
        max_value=MAX_INT,
    )
    requeue_on_node_loss = serializers.BooleanField(required=False, default=True)
    checkpointable = StrictBool(
        required=False,
        default=False,
        help_text="It saves checkpoints: preempted, it gets checkpoint_signal,"
        " checkpoint_grace_s to save and exit, and is requeued.",
    )
    checkpoint_signal = Text(
        required=False,
        default="",
        max_length=1000,
        help_text="TERM (default), INT, USR1 or USR2.",
    )
    checkpoint_grace_s = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=-MAX_INT,
        max_value=MAX_INT,
        help_text="Seconds from the checkpoint signal to SIGKILL (default 60).",
    )
    after = Text(
        required=False,
        default="",
        max_length=10_000,
        help_text="Jobs to run after: afterok:12:13,afterany:14,afternotok:a7 (a7:"
        " every task of array 7; a bare id means afterany).",
    )


class ArrayRequestSerializer(JobRequestSerializer):
    array = Text(
        max_length=10_000,
        help_text="The tasks' indexes and the run-at-once limit: 0-99%8, 1,3,5-7,"
        " 0-10:2.",
    )


# ------------------------------------------------------------------ jobs out


class DependencyOut(serializers.Serializer[JobDependency]):
    type = serializers.CharField(source="kind")
    job = serializers.IntegerField(source="depends_on_id")
    state = serializers.CharField(source="depends_on.status")


class JobSerializer(serializers.Serializer[Job]):
    id = serializers.IntegerField()
    name = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    group = serializers.CharField(source="group.name")
    state = serializers.ChoiceField(choices=STATES, source="status")
    priority_class = serializers.CharField()
    gpus = serializers.IntegerField()
    gpu_memory_mib = serializers.IntegerField(allow_null=True)
    gpu_model = serializers.CharField()
    time_limit_s = serializers.IntegerField()
    predicted_runtime_s = serializers.IntegerField(allow_null=True)
    shareable = serializers.BooleanField()
    slowdown_cap = serializers.FloatField(
        allow_null=True,
        help_text="Its own slowdown cap when sharing a GPU; null: its class's.",
    )
    evictable = serializers.BooleanField(
        help_text="Whether it is requeued when its GPU partner suffers.",
    )
    workload = serializers.CharField()
    command = serializers.CharField()
    workdir = serializers.CharField(
        help_text="The directory it runs in, normalised ('..' resolved).",
    )
    env = serializers.DictField(child=serializers.CharField())
    kill_grace_s = serializers.IntegerField(
        help_text="Seconds between SIGTERM and SIGKILL when it is stopped.",
    )
    requeue_on_node_loss = serializers.BooleanField(
        help_text="Requeued (true) or failed (false) when its node is lost.",
    )
    checkpointable = serializers.BooleanField()
    checkpoint_signal = serializers.CharField(
        help_text="The signal a preemption sends first (checkpointable jobs).",
    )
    checkpoint_grace_s = serializers.IntegerField(
        help_text="Seconds from the checkpoint signal to SIGKILL.",
    )
    restarts = serializers.SerializerMethodField(
        help_text="Times it was resumed after being stopped to be requeued.",
    )
    lost_work_gpu_s = serializers.SerializerMethodField(
        help_text="Work its requeued attempts lost (since their last checkpoint,"
        " or since their start), in GPU-seconds.",
    )
    submitted_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    exit_code = serializers.IntegerField(allow_null=True)
    end_reason = serializers.CharField()
    reason = serializers.CharField(
        source="pending_reason",
        help_text="Why it waits (pending, held): priority, resources, dependency,"
        " dependency_never, array_limit, quota, held, ...",
    )
    reason_message = serializers.CharField(source="pending_message")
    queue_position = serializers.IntegerField(allow_null=True)
    est_start = serializers.DateTimeField(allow_null=True)
    attempts = serializers.IntegerField()
    cancel_requested = serializers.SerializerMethodField()
    held_by = serializers.SerializerMethodField()
    nodes = serializers.SerializerMethodField()
    array = serializers.IntegerField(source="array_id", allow_null=True)
    array_index = serializers.IntegerField(allow_null=True)
    dependencies = DependencyOut(many=True, source="dependencies.all")
    expected_end = serializers.SerializerMethodField(
        help_text="A running job's expected end (from its reported progress,"
        " else its planned run time or limit, as the scheduler plans); null"
        " otherwise.",
    )

    def get_expected_end(self, job: Job) -> str | None:
        if job.status != Job.Status.RUNNING:
            return None
        live = [a for a in job.attempt_set.all() if a.ended_at is None]
        got = expected_end.of(job, live[0] if live else None, timezone.now())
        if got is None:
            return None
        # written as ``est_start`` and the other times are
        return str(serializers.DateTimeField().to_representation(got.at))

    def get_restarts(self, job: Job) -> int:
        return job.restarts()[0]

    def get_lost_work_gpu_s(self, job: Job) -> int:
        return job.restarts()[1]

    def get_cancel_requested(self, job: Job) -> bool:
        return job.cancel_requested_at is not None

    def get_held_by(self, job: Job) -> str | None:
        return job.held_by.username if job.held_by is not None else None

    def get_nodes(self, job: Job) -> list[str]:
        return latest_nodes(job, self.context.get("node_names", {}))


def latest_nodes(job: Job, names: dict[int, str]) -> list[str]:
    """The nodes of its latest attempt, rank 0 first (none before a start);
    reads the prefetched ``attempt_set`` (``views.common.jobs_for``)."""
    if not job.attempts:  # never started: no attempt to read
        return []
    attempts = list(job.attempt_set.all())
    if not attempts:
        return []
    last = max(attempts, key=lambda a: a.number)
    return [names.get(n, str(n)) for n in last.node_ids]


class JobPageSerializer(serializers.Serializer[Any]):
    count = serializers.IntegerField()
    next = serializers.CharField(allow_null=True)
    previous = serializers.CharField(allow_null=True)
    results = JobSerializer(many=True)


class JobListQuery(serializers.Serializer[Any]):
    """Filters of the job list."""

    state = Text(
        required=False,
        max_length=1000,
        help_text=f"States, comma-separated: {', '.join(STATES)}; 'active' for"
        " pending, held, starting and running.",
    )
    owner = Text(required=False, max_length=150, help_text="A username.")
    group = Text(required=False, max_length=64, help_text="A group name.")
    node = Text(
        required=False, max_length=63, help_text="Jobs with an attempt on this node."
    )
    array = serializers.IntegerField(required=False, min_value=1, max_value=2**62)
    since = Moment(
        required=False, help_text="Jobs not ended before this time (ISO 8601)."
    )
    until = Moment(
        required=False, help_text="Jobs submitted before this time (ISO 8601)."
    )
    limit = serializers.IntegerField(
        required=False,
        default=100,
        min_value=1,
        max_value=settings.GPULAB_API_MAX_PAGE,
        help_text="Jobs per page (at most"
        f" {settings.GPULAB_API_MAX_PAGE}, GPULAB_API_MAX_PAGE).",
    )
    offset = serializers.IntegerField(
        required=False,
        default=0,
        min_value=0,
        max_value=settings.GPULAB_API_MAX_OFFSET,
        help_text="Skip this many jobs (at most"
        f" {settings.GPULAB_API_MAX_OFFSET}, GPULAB_API_MAX_OFFSET): deeper,"
        " narrow the list with since, until or state instead.",
    )

    def validate_state(self, value: str) -> list[str]:
        states: list[str] = []
        for part in (p.strip().lower() for p in value.split(",")):
            if part == "active":
                states += [str(s) for s in Job.ACTIVE]
            elif part in STATES:
                states.append(part)
            elif part:
                raise serializers.ValidationError(
                    f"Unknown state {part!r}; use {', '.join(STATES)} or active."
                )
        return states

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        since, until = attrs.get("since"), attrs.get("until")
        if since is not None and until is not None and since > until:
            raise serializers.ValidationError({"until": "It is before since."})
        return attrs


class EventSerializer(serializers.Serializer[JobEvent]):
    at = serializers.DateTimeField()
    source = serializers.CharField()  # type: ignore[assignment]
    actor = serializers.SerializerMethodField()
    from_state = serializers.CharField(source="from_status")
    to_state = serializers.CharField(source="to_status")
    message = serializers.CharField()

    def get_actor(self, event: JobEvent) -> str | None:
        return event.actor.username if event.actor is not None else None


class LogQuery(serializers.Serializer[Any]):
    attempt = serializers.IntegerField(
        required=False, min_value=1, max_value=MAX_INT, help_text="Default: the latest."
    )
    rank = serializers.IntegerField(
        required=False, default=0, min_value=0, max_value=10_000
    )
    offset = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=2**62,
        help_text="Bytes from this offset of the output (the next_offset of the"
        " previous call, to follow it).",
    )
    tail = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=4 * 1024 * 1024,
        help_text="Only the last N bytes.",
    )
    limit = serializers.IntegerField(
        required=False,
        default=256 * 1024,
        min_value=1,
        max_value=4 * 1024 * 1024,
        help_text="At most this many bytes.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "offset" in attrs and "tail" in attrs:
            raise serializers.ValidationError(
                {"tail": "Give offset (follow) or tail, not both."}
            )
        return attrs


class LogSerializer(serializers.Serializer[Any]):
    job = serializers.IntegerField()
    attempt = serializers.IntegerField(allow_null=True)
    rank = serializers.IntegerField()
    node = serializers.CharField(allow_null=True)
    offset = serializers.IntegerField()
    next_offset = serializers.IntegerField()
    data = serializers.CharField()  # type: ignore[assignment]
    complete = serializers.BooleanField(
        help_text="The attempt has ended and nothing is left after next_offset."
    )


# ------------------------------------------------------------------ arrays


class TaskSerializer(serializers.Serializer[Job]):
    id = serializers.IntegerField()
    index = serializers.IntegerField(source="array_index")
    state = serializers.ChoiceField(choices=STATES, source="status")
    reason = serializers.CharField(source="pending_reason")
    exit_code = serializers.IntegerField(allow_null=True)


class ArraySerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    name = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    spec = serializers.CharField()
    size = serializers.IntegerField()
    max_running = serializers.IntegerField(allow_null=True)
    created_at = serializers.DateTimeField()
    counts = serializers.DictField(
        child=serializers.IntegerField(), help_text="Tasks per state."
    )
    tasks = TaskSerializer(many=True)


class CancelledSerializer(serializers.Serializer[Any]):
    cancelled = serializers.ListField(child=serializers.IntegerField())
