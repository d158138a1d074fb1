"""What the API reads and writes. Input serializers parse JSON into strictly
typed values (like the submit form parses text) and check the static limits the
OpenAPI schema states (lengths, ranges, characters, choices), so that the schema
is the contract; the rules that depend on the cluster, the database or another
field live in ``scheduler.services`` and come back as a field-keyed 400 too.
Output serializers are read-only views of the rows."""

from __future__ import annotations

import math
import re
from functools import cached_property
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import RegexValidator
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema_field
from rest_framework import serializers

from portal import expected_end
from scheduler.models import Attempt, Job, JobDependency, JobEvent
from scheduler.services import MAX_ARRAY_INDEX, MAX_KILL_GRACE_S

MAX_INT = 2**31 - 1
STATES = [s.value for s in Job.Status]


class Text(serializers.CharField):
    """A string that PostgreSQL can store: no NUL (DRF's default validator) and
    no lone surrogate (JSON allows ``"\\ud800"``; UTF-8 does not)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_blank", True)
        kwargs.setdefault("trim_whitespace", False)
        # a pattern the schema states (DRF refuses NUL without saying so)
        kwargs.setdefault(
            "validators",
            [_matching(r"^[^\u0000]+$", "Null characters are not allowed.")],
        )
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


class StrictInteger(serializers.IntegerField):
    """A JSON integer: not a boolean (``true`` is not 1), a string ("12") or
    a fraction (2.0), which DRF's ``IntegerField`` would take."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class StrictNumber(serializers.FloatField):
    """A finite JSON number: not a boolean or a string ("1.5", "nan")."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            self.fail("invalid")
        if not math.isfinite(data):
            self.fail("invalid")
        return float(super().to_internal_value(data))


class StrictBoolean(serializers.BooleanField):
    """A JSON boolean: not 1, "yes", "true" or "on" (DRF's ``BooleanField``
    takes each of them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error_messages["invalid"] = "Must be true or false."

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


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


def _no_chars(forbidden: str, *, non_blank: bool = False, empty: bool = False) -> str:
    """A pattern (Python's ``re`` and ECMA-262 read it alike) for text without
    the ``forbidden`` characters (a character class body) and, when
    ``non_blank``, with a character other than whitespace. Leading whitespace
    and the first other character cannot overlap, so matching is linear.

    Without ``empty`` the pattern refuses "": a field that may be blank takes
    "" before its validators run, and its schema says so apart (``oneOf`` a
    pattern or ``maxLength: 0``: exactly one of them must match)."""
    if not non_blank:
        return f"^[^{forbidden}]{'*' if empty else '+'}$"
    return f"^[{SPACE}]*[^{forbidden}{SPACE}][^{forbidden}]*$"


# What str.strip() removes (str.isspace()), spelled out: ECMA's \s differs.
SPACE = (
    r"\t\n\u000b\u000c\r\u001c-\u001f \u0085\u00a0\u1680\u2000-\u200a"
    r"\u2028\u2029\u202f\u205f\u3000"
)
# C0 and C1 controls (Unicode's Cc); with tab, newline and carriage return
# allowed (commands, environment values); bidirectional-text controls, which
# make a name display as something else.
CONTROLS = r"\u0000-\u001f\u007f-\u009f"
CONTROLS_BUT_LINES = r"\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f-\u009f"
BIDI = r"\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"


class Matching(RegexValidator):
    """A pattern the schema states as written (``self.regex``, which
    drf-spectacular reads) and the server checks as ECMA-262 does: ``$`` at
    the very end, where Python's ``$`` also matches before a final newline."""

    def __init__(self, pattern: str, message: str) -> None:
        # Django %-formats a validator's message with the value
        super().__init__(pattern, message=message.replace("%", "%%"))
        self.plain = message  # raised below without params: no %-formatting
        self.whole = re.compile(pattern.removesuffix("$") + r"\Z")

    def __call__(self, value: Any) -> None:
        text = str(value)
        if self.whole.search(text) is None:
            raise DjangoValidationError(
                self.plain + _first_hidden(text), code=self.code
            )


_HIDDEN = re.compile(f"[{CONTROLS}{BIDI}]")


def _first_hidden(text: str) -> str:
    """ " It has U+202E." for the first control or bidirectional-text character of
    ``text``, which a page would not show: the user learns which one to remove."""
    found = _HIDDEN.search(text)
    return f" It has U+{ord(found.group()):04X}." if found else ""


def _matching(pattern: str, message: str) -> Matching:
    return Matching(pattern, message)


LINE = "no control or bidirectional-text characters"
# The classes a request may name: an interactive job's class is implied by
# ``interactive`` (a batch job may not choose it).
CLASSES = [
    name
    for name, spec in settings.GPULAB_PRIORITY_CLASSES.items()
    if not spec.get("interactive")
]
MAX_TIME_LIMIT_S = max(
    int(c["max_time_limit"]) for c in settings.GPULAB_PRIORITY_CLASSES.values()
)
# The most GPUs one job may ask for; the cluster's own size (of the model
# asked for) is the real bound, checked at submission.
MAX_JOB_GPUS = 1024
# An array spec: comma-separated N, A-B or A-B:STEP, then optionally %LIMIT.
_INDEXES = r"[0-9]{1,7}(-[0-9]{1,7}(:[0-9]{1,7})?)?"
_S = f"[{SPACE}]*"
ARRAY_PATTERN = f"^{_S}{_INDEXES}{_S}(,{_S}{_INDEXES}{_S})*(%[0-9]{{1,7}})?{_S}$"


MAX_ENV = 200
MAX_ENV_VALUE = 100_000
ENV_VALUE_PATTERN = _no_chars(CONTROLS_BUT_LINES, empty=True)


@extend_schema_field(
    {
        "type": "object",
        "maxProperties": MAX_ENV,
        "additionalProperties": {
            "type": "string",
            "maxLength": MAX_ENV_VALUE,
            "pattern": ENV_VALUE_PATTERN,
        },
    }
)
class Env(serializers.DictField):
    """Environment variables: a JSON object of at most ``MAX_ENV`` strings."""

    def __init__(self, **kwargs: Any) -> None:
        value = Text(
            max_length=MAX_ENV_VALUE,
            validators=[
                _matching(
                    ENV_VALUE_PATTERN,
                    "Has control characters (other than tab and line breaks).",
                )
            ],
        )
        super().__init__(child=value, **kwargs)

    def to_internal_value(self, data: Any) -> dict[str, str]:
        if isinstance(data, dict) and len(data) > MAX_ENV:
            raise serializers.ValidationError(f"At most {MAX_ENV} variables.")
        return dict(super().to_internal_value(data))


# What an interactive job's request may not name (gpulab sets it): refused by
# the view, forbidden by the schema (``schema.job_request_kinds``).
INTERACTIVE_SETS = (
    "command",
    "env",
    "priority_class",
    "gpu_model",
    "slowdown_cap",
    "evictable",
    "workload",
    "kill_grace_s",
    "requeue_on_node_loss",
    "after",
    "checkpointable",
    "checkpoint_signal",
    "checkpoint_grace_s",
)


class JobRequestSerializer(serializers.Serializer[Any]):
    """A job to submit (``services.JobRequest``). Each field's JSON type is
    strict, and its static limits (lengths, ranges, characters, choices) are
    checked here, so that the OpenAPI schema states them; the rules that
    depend on the cluster, on the database or on another field are the
    services' (``validate_job_request``), and also answer 400 naming the field."""

    name = Text(
        max_length=128,
        allow_blank=False,
        required=False,
        default="",
        help_text="Required for a batch job (an interactive job's default:"
        " JupyterLab, terminal).",
        validators=[
            _matching(
                _no_chars(CONTROLS + BIDI, non_blank=True),
                f"Give the job a name: not blank, {LINE}.",
            )
        ],
    )
    command = Text(
        max_length=settings.GPULAB_MAX_COMMAND_BYTES,
        allow_blank=False,
        required=False,
        default="",
        help_text="Required for a batch job, left out for an interactive one"
        " (gpulab writes its command). Run by /bin/sh in the working directory;"
        f" at most {settings.GPULAB_MAX_COMMAND_BYTES} bytes of UTF-8.",
        validators=[
            _matching(
                _no_chars(CONTROLS_BUT_LINES, non_blank=True),
                "The command is blank or has control characters (other than"
                " tab and line breaks).",
            )
        ],
    )
    interactive = serializers.ChoiceField(
        choices=["", "jupyter", "shell"],
        required=False,
        default="",
        allow_blank=True,
        help_text="An interactive job: jupyter (JupyterLab, opened at"
        " /interactive/<id>/) or shell (a terminal); it runs in the interactive"
        " class, takes gpus, gpu_memory_mib, time_limit_s, shareable, group,"
        " workdir and name only, and each user may have"
        f" {settings.GPULAB_INTERACTIVE_MAX_PER_USER} unfinished at most"
        " (GPULAB_INTERACTIVE_MAX_PER_USER).",
    )
    workdir = Text(
        required=False,
        default="",
        max_length=1024,
        help_text="An absolute path (default: GPULAB_DEFAULT_WORKDIR).",
        validators=[
            _matching(
                f"^([{SPACE}]+|[{SPACE}]*/[^{CONTROLS}]*)$",
                "The working directory must be an absolute path without control"
                " characters.",
            )
        ],
    )
    env = Env(
        required=False,
        default=dict,
        help_text="Variables: names as in the shell ([A-Za-z_][A-Za-z0-9_]*), not"
        " CUDA_VISIBLE_DEVICES or GPULAB_*; at most 200.",
    )
    gpus = StrictInteger(
        required=False,
        default=1,
        min_value=1,
        max_value=MAX_JOB_GPUS,
        help_text="At most the cluster's GPUs (of gpu_model, if given).",
    )
    gpu_memory_mib = StrictInteger(
        required=False,
        allow_null=True,
        default=None,
        min_value=1,
        max_value=MAX_INT,
        help_text="At most the largest GPU's memory.",
    )
    gpu_model = Text(
        required=False,
        default="",
        max_length=64,
        help_text="Part of a GPU model's name the cluster has.",
        validators=[_matching(_no_chars(CONTROLS), "Has control characters.")],
    )
    time_limit_s = StrictInteger(
        required=False,
        allow_null=True,
        default=None,
        min_value=1,
        max_value=MAX_TIME_LIMIT_S,
        help_text="Seconds; at most the priority class's limit (default: the"
        " class's default).",
    )
    priority_class = serializers.ChoiceField(
        choices=CLASSES,
        required=False,
        default="",
        allow_blank=True,
        help_text=f"Default: {settings.GPULAB_DEFAULT_CLASS}.",
        error_messages={
            "invalid_choice": f"Unknown class {{input!r}}; choose one of:"
            f" {', '.join(CLASSES)}."
        },
    )
    shareable = StrictBoolean(required=False, default=False)
    slowdown_cap = StrictNumber(
        required=False,
        allow_null=True,
        default=None,
        min_value=1.0,
        help_text="Only with shareable; at most the class's cap.",
    )
    evictable = StrictBoolean(required=False, default=True)
    workload = Text(
        required=False,
        default="",
        max_length=128,
        validators=[
            _matching(_no_chars(CONTROLS + BIDI), f"The workload label has {LINE}.")
        ],
    )
    group = Text(
        required=False,
        default="",
        max_length=64,
        help_text="A group you are a member of (default: your primary group).",
    )
    kill_grace_s = StrictInteger(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        max_value=MAX_KILL_GRACE_S,
        help_text="Seconds between SIGTERM and SIGKILL (default: GPULAB_KILL_GRACE).",
    )
    requeue_on_node_loss = StrictBoolean(required=False, default=True)
    checkpointable = StrictBoolean(
        required=False,
        default=False,
        help_text="It saves checkpoints: preempted, it gets checkpoint_signal,"
        " checkpoint_grace_s to save and exit, and is requeued.",
    )
    checkpoint_signal = Text(
        required=False,
        default="",
        max_length=16,
        help_text="TERM (default), INT, USR1 or USR2 (any case, SIG prefix"
        " optional); only for a checkpointable job.",
        validators=[
            _matching(
                r"^(|([Ss][Ii][Gg])?([Tt][Ee][Rr][Mm]|[Ii][Nn][Tt]|[Uu][Ss][Rr][12]))$",
                "Unknown checkpoint signal; choose one of: TERM, INT, USR1, USR2.",
            )
        ],
    )
    checkpoint_grace_s = StrictInteger(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        max_value=MAX_KILL_GRACE_S,
        help_text="Seconds from the checkpoint signal to SIGKILL (default 60);"
        " only for a checkpointable job.",
    )
    after = Text(
        required=False,
        default="",
        max_length=10_000,
        help_text="Jobs to run after: afterok:12:13,afterany:14,afternotok:a7 (a7:"
        " every task of array 7; a bare id means afterany).",
    )


class ArrayRequestSerializer(JobRequestSerializer):
    # Every task of an array runs the command it names; no interactive tasks.
    name = Text(
        max_length=128,
        allow_blank=False,
        validators=[
            _matching(
                _no_chars(CONTROLS + BIDI, non_blank=True),
                f"Give the job a name: not blank, {LINE}.",
            )
        ],
    )
    command = Text(
        max_length=settings.GPULAB_MAX_COMMAND_BYTES,
        allow_blank=False,
        help_text="Run by /bin/sh in the working directory; at most"
        f" {settings.GPULAB_MAX_COMMAND_BYTES} bytes of UTF-8.",
        validators=[
            _matching(
                _no_chars(CONTROLS_BUT_LINES, non_blank=True),
                "The command is blank or has control characters (other than"
                " tab and line breaks).",
            )
        ],
    )
    interactive = None  # type: ignore[assignment]
    array = Text(
        max_length=10_000,
        allow_blank=False,
        help_text="The tasks' indexes and the run-at-once limit: 0-99%8, 1,3,5-7,"
        f" 0-10:2; at most {settings.GPULAB_MAX_ARRAY_SIZE} tasks, indexes up to"
        f" {MAX_ARRAY_INDEX}, a limit of 1 to {settings.GPULAB_MAX_ARRAY_SIZE}.",
        validators=[
            _matching(
                ARRAY_PATTERN,
                "Write the indexes as N, A-B or A-B:STEP, comma-separated, then"
                " optionally %LIMIT: e.g. 0-99%8 or 1,3,5-7.",
            )
        ],
    )


# ------------------------------------------------------------------ jobs out

_FALLBACK = object()


class ListedFast(serializers.Serializer[Any]):
    """A serializer whose items are written without DRF's generic steps per
    field: a page of 1,000 jobs has 45,000 fields, and DRF's per-field lookup
    (``Field.get_attribute``, its callable checks and exception handling) cost
    more than the values themselves (bench/bounded_cost.py). Each field's value
    is read with ``getattr`` along its source and written by the field's own
    ``to_representation``; a method field calls its method. Whatever that
    plain reading cannot settle (a callable, a missing attribute, a field with
    its own ``get_attribute``) goes to DRF's own steps for that field, so the
    output is DRF's (``tests/api/test_job_list_cost.py`` compares them)."""

    @cached_property
    def _writers(self) -> list[tuple[str, Any, Any]]:
        """(name, how to read, how to write) per readable field."""
        plan: list[tuple[str, Any, Any]] = []
        for field in self._readable_fields:
            name = str(field.field_name)
            if isinstance(field, serializers.SerializerMethodField):
                plan.append((name, getattr(self, field.method_name), None))
            elif type(field).get_attribute is serializers.Field.get_attribute and (
                field.source != "*"
            ):
                plan.append((name, tuple(field.source_attrs), field))
            else:
                plan.append((name, field, field))
        return plan

    def to_representation(self, instance: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, read, field in self._writers:
            if field is None:  # a method field
                out[name] = read(instance)
                continue
            value: Any = _FALLBACK
            if type(read) is tuple:
                value = instance
                try:
                    for attr in read:
                        # DRF's rules decide a missing step (None, a default,
                        # skipped) and call a method found on the way
                        if value is None:
                            value = _FALLBACK
                            break
                        value = getattr(value, attr)
                        if callable(value):
                            value = _FALLBACK
                            break
                except Exception:  # as DRF would: None, a default, skipped, raised
                    value = _FALLBACK
            if value is _FALLBACK:
                try:
                    value = field.get_attribute(instance)
                except serializers.SkipField:
                    continue
            out[name] = None if value is None else field.to_representation(value)
        return out


class DependencyOut(ListedFast, serializers.Serializer[JobDependency]):
    type = serializers.CharField(source="kind")
    job = serializers.IntegerField(source="depends_on_id")
    # annotated by ``views.common.dependencies_out``
    state = serializers.CharField(source="depends_on_state")


class JobSerializer(ListedFast, serializers.Serializer[Job]):
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
    interactive = serializers.CharField(
        help_text="'' (batch), jupyter or shell: an interactive job.",
    )
    interactive_url = serializers.SerializerMethodField(
        help_text="Where the portal serves its JupyterLab (jupyter jobs), to its"
        " owner only; '' otherwise.",
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
    guest = serializers.SerializerMethodField(
        help_text="A running job started as a guest: ahead of its turn, on GPUs"
        " held for the first job waiting; it is stopped with its checkpoint"
        " signal and requeued when that job can start. False otherwise.",
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
    dependencies = DependencyOut(many=True, source="dependency_list")
    expected_end = serializers.SerializerMethodField(
        help_text="A running job's expected end (from its reported progress,"
        " else its planned run time or limit, as the scheduler plans); null"
        " otherwise.",
    )

    def get_expected_end(self, job: Job) -> str | None:
        if job.status != Job.Status.RUNNING:
            return None
        return expected_end_text(job, attempts_of(job))

    def get_interactive_url(self, job: Job) -> str:
        return interactive_url(job.pk, job.interactive)

    def get_restarts(self, job: Job) -> int:
        return job.restarts()[0]

    def get_lost_work_gpu_s(self, job: Job) -> int:
        return job.restarts()[1]

    def get_guest(self, job: Job) -> bool:
        if job.status != Job.Status.RUNNING:
            return False
        return any(a.guest for a in attempts_of(job) if a.ended_at is None)

    def get_cancel_requested(self, job: Job) -> bool:
        return job.cancel_requested_at is not None

    def get_held_by(self, job: Job) -> str | None:
        return job.held_by.username if job.held_by is not None else None

    def get_nodes(self, job: Job) -> list[str]:
        return latest_nodes(job, self.context.get("node_names", {}))


def attempts_of(job: Job) -> list[Attempt]:
    """Its attempts as read with it (``views.common.attempts_for_nodes``); a
    query of its own for a job read without them."""
    read: list[Attempt] | None = getattr(job, "attempt_list", None)
    return read if read is not None else list(job.attempt_set.all())


def latest_nodes(job: Job, names: dict[int, str]) -> list[str]:
    """The nodes of its latest attempt, rank 0 first (none before a start)."""
    if not job.attempts:  # never started: no attempt to read
        return []
    attempts = attempts_of(job)
    if not attempts:
        return []
    last = max(attempts, key=lambda a: a.number)
    return node_names_of(last.node_ids, names)


def node_names_of(node_ids: list[int], names: dict[int, str]) -> list[str]:
    """Nodes by name (an id no longer named: the id), in the order given."""
    return [names.get(n, str(n)) for n in node_ids]


def expected_end_text(job: Job, attempts: list[Attempt]) -> str | None:
    """A running job's expected end (``portal.expected_end``) from its attempts
    (its live one: the one not ended), written as the API writes its times."""
    live = [a for a in attempts if a.ended_at is None]
    got = expected_end.of(job, live[0] if live else None, timezone.now())
    if got is None:
        return None
    # written as ``est_start`` and the other times are
    return str(serializers.DateTimeField().to_representation(got.at))


def interactive_url(job_id: int, interactive: str) -> str:
    """Where the portal serves a JupyterLab job's notebook; '' for other jobs."""
    return f"/interactive/{job_id}/" if interactive == "jupyter" else ""


class JobPageSerializer(serializers.Serializer[Any]):
    count = serializers.IntegerField(
        help_text="The jobs the filters match (with before: those below it)."
    )
    next = serializers.CharField(
        allow_null=True,
        help_text="The next page's URL, null after the last; asked with before, it"
        " carries the cursor on (before = this page's last id).",
    )
    previous = serializers.CharField(
        allow_null=True,
        help_text="The page before's URL (by offset), null at offset 0.",
    )
    results = JobSerializer(many=True)


STATE_HELP = (
    f"States, comma-separated: {', '.join(STATES)}; 'active' for pending, held,"
    " starting and running."
)
# The job list's ``state`` as the schema states it: a list of names, sent
# comma-separated (``style: form, explode: false``): ?state=pending,running.
STATE_PARAMETER = OpenApiParameter(
    "state",
    {
        "type": "array",
        "items": {"type": "string", "enum": [*STATES, "active"]},
        "minItems": 1,
    },
    OpenApiParameter.QUERY,
    required=False,
    style="form",
    explode=False,
    description=STATE_HELP,
)


class JobListQuery(serializers.Serializer[Any]):
    """Filters of the job list."""

    state = Text(
        required=False,
        max_length=1000,
        help_text=STATE_HELP,
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
        " narrow the list with since, until or state, or page with before.",
    )
    before = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=2**62,
        help_text="Only jobs with a lower id, i.e. submitted earlier (a cursor: give"
        " the last id of the page before). A page from a cursor costs what a first"
        " page does however deep it is, where an offset's cost grows with the"
        " jobs it skips; with before, next carries the cursor on. count, offset"
        " and previous count the jobs below it.",
    )

    def validate_state(self, value: str) -> list[str]:
        """Exactly the schema's list (``STATE_PARAMETER``): names as written,
        comma-separated, no blanks."""
        states: list[str] = []
        for part in value.split(","):
            if part == "active":
                states += [str(s) for s in Job.ACTIVE]
            elif part in STATES:
                states.append(part)
            else:
                raise serializers.ValidationError(
                    f"Unknown state {part[:40]!r}; use {', '.join(STATES)} or active,"
                    " comma-separated."
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
