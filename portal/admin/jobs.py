"""The console's jobs and their records: jobs with the admin's verbs as actions
(cancel, requeue, priority class, hold, release), each behind its permission,
reporting per job and changing state only through ``scheduler.services``; a
waiting job's request changed through ``services.change_job_request``; their
attempts, allocations, events, output and progress samples, read only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import OuterRef, Subquery
from django.template.response import TemplateResponse

from portal.admin.common import ReadOnlyAdmin, acting_user, report_action
from portal.idle.admin import IdleJobFilter
from scheduler import classes, services
from scheduler.models import (
    Allocation,
    Attempt,
    Job,
    JobEvent,
    JobLogChunk,
    ProgressSample,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.db.models import QuerySet
    from django.http import HttpRequest


class JobEventInline(admin.TabularInline[JobEvent, Job]):
    """The job's history, read only (written by the services)."""

    model = JobEvent
    extra = 0
    can_delete = False
    readonly_fields = ("at", "source", "actor", "from_status", "to_status", "message")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class JobRequestForm(forms.ModelForm[Job]):
    """The change form of a waiting job: the request as it would become is
    checked by the submit form's and the API's rules
    (``services.validate_request_change``), every problem at once."""

    class Meta:
        model = Job
        fields = services.REQUEST_FIELDS

    def changes(self) -> dict[str, Any]:
        """The request fields the admin changed, cleaned by the form."""
        return {
            f: self.cleaned_data[f]
            for f in self.changed_data
            if f in services.REQUEST_FIELDS and f in self.cleaned_data
        }

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        changes = self.changes()
        env = changes.get("env")
        if env is not None and not (
            isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            self.add_error("env", 'A JSON object of names and text values: {"A": "1"}.')
            return cleaned
        if not changes:
            return cleaned
        try:
            services.validate_request_change(self.instance, changes)
        except ValidationError as exc:
            for field, messages in exc.message_dict.items():
                self.add_error(field if field in self.fields else None, messages)
        return cleaned


class PriorityClassForm(forms.Form):
    """The intermediate page of "Change the priority class"."""

    priority_class = forms.ChoiceField(
        choices=classes.class_choices, label="New priority class"
    )


@admin.register(Job)
class JobAdmin(admin.ModelAdmin[Job]):
    """Every job, with the admin's verbs as actions (cancel, requeue, priority
    class, hold, release), each behind its permission and reporting per job. State
    is changed only through ``scheduler.services``; jobs are not added or deleted
    here (submit from the portal; deleting would lose their usage).

    A job's request (``services.REQUEST_FIELDS``) may be changed in its change
    form while it waits, validated as at submission and written by
    ``services.change_job_request`` (one event, and the admin's history); once it
    has left PENDING the form is read only and a POST to it is refused (403).
    Every other field is read only always."""

    form = JobRequestForm

    list_display = (
        "id",
        "name",
        "owner",
        "group",
        "status",
        "priority_class",
        "gpus",
        "node",
        "submitted_at",
        "started_at",
        "waiting_because",
    )
    list_display_links = ("id", "name")
    list_filter = (
        "status",
        "priority_class",
        "group",
        "shareable",
        IdleJobFilter,
        "submitted_at",
    )
    list_select_related = ("owner", "group")
    search_fields = ("=id", "name", "owner__username", "workload", "command")
    date_hierarchy = "submitted_at"
    # An interactive job's secret is shown to no one, staff included.
    exclude = ("interactive_token",)
    readonly_fields = (
        "status",
        "priority_class",
        "held_by",
        "pending_reason",
        "pending_message",
        "queue_position",
        "priority_breakdown",
        "est_start",
        "preemptions",
        "last_preempted_at",
        "cancel_requested_at",
        "attempts",
        "exit_code",
        "end_reason",
        "submitted_at",
        "started_at",
        "finished_at",
    )
    inlines = (JobEventInline,)
    actions = (
        "cancel_jobs",
        "requeue_jobs",
        "change_priority",
        "hold_jobs",
        "release_jobs",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        live_node = Attempt.objects.filter(
            job=OuterRef("pk"), ended_at__isnull=True
        ).values("node__name")[:1]
        return super().get_queryset(request).annotate(node_name=Subquery(live_node))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: Job | None = None
    ) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: Job | None = None
    ) -> bool:
        """A job's change form takes changes only while it waits."""
        if obj is not None and obj.status != Job.Status.PENDING:
            return False
        return super().has_change_permission(request, obj)

    def get_readonly_fields(
        self, request: HttpRequest, obj: Job | None = None
    ) -> tuple[str, ...]:
        editable = services.REQUEST_FIELDS if obj is not None else ()
        rest = [
            f.name
            for f in Job._meta.fields
            if f.name not in editable
            and f.name not in self.readonly_fields
            and f.name not in self.exclude
        ]
        return (*self.readonly_fields, *rest)

    def save_model(
        self,
        request: HttpRequest,
        obj: Job,
        form: JobRequestForm,
        change: bool,  # noqa: FBT001 - Django's signature
    ) -> None:
        """Through the service: it locks the job, checks that it still waits and
        validates again (a job that started meanwhile: 403, nothing changed)."""
        try:
            services.change_job_request(obj.pk, form.changes(), by=acting_user(request))
        except services.JobStateError as exc:
            raise PermissionDenied(str(exc)) from exc

    def has_cancel_any_job_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("scheduler.cancel_any_job")

    def has_hold_job_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("scheduler.hold_job")

    def has_requeue_job_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("scheduler.requeue_job")

    def has_change_job_priority_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("scheduler.change_job_priority")

    @admin.display(description="node", ordering="node_name")
    def node(self, obj: Job) -> str:
        return str(getattr(obj, "node_name", None) or "\u2013")

    @admin.display(description="waiting because")
    def waiting_because(self, obj: Job) -> str:
        if obj.status not in (Job.Status.PENDING, Job.Status.HELD):
            return ""
        return obj.pending_message

    def _each(
        self,
        request: HttpRequest,
        queryset: QuerySet[Job],
        verb: str,
        act: Callable[[int], Job],
    ) -> None:
        """Apply a service to each selected job on its own (each locks its row);
        a job in the wrong state is skipped with the service's reason."""
        done, skipped = 0, []
        for pk in queryset.order_by("pk").values_list("pk", flat=True):
            try:
                job = act(pk)
            except (services.JobStateError, PermissionDenied, ValueError) as exc:
                skipped.append(str(exc))
            else:
                done += 1
                self.log_change(request, job, verb)
        report_action(self, request, verb, done, skipped)

    @admin.action(description="Cancel", permissions=["cancel_any_job"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = acting_user(request)
        self._each(
            request, queryset, "cancelled", lambda pk: services.cancel_job(pk, by=by)
        )

    @admin.action(
        description="Requeue: stop and send back to the queue (age kept)",
        permissions=["requeue_job"],
    )
    def requeue_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = acting_user(request)
        self._each(
            request, queryset, "requeued", lambda pk: services.requeue_job(pk, by=by)
        )

    @admin.action(description="Hold: keep from starting", permissions=["hold_job"])
    def hold_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = acting_user(request)
        self._each(request, queryset, "held", lambda pk: services.hold_job(pk, by=by))

    @admin.action(description="Release a hold", permissions=["hold_job"])
    def release_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = acting_user(request)
        self._each(
            request, queryset, "released", lambda pk: services.release_job(pk, by=by)
        )

    @admin.action(
        description="Change the priority class\u2026",
        permissions=["change_job_priority"],
    )
    def change_priority(
        self, request: HttpRequest, queryset: QuerySet[Job]
    ) -> TemplateResponse | None:
        """An intermediate page asks for the class; its form posts the same
        action again with ``apply``."""
        form = PriorityClassForm(request.POST if "apply" in request.POST else None)
        if form.is_valid():
            by = acting_user(request)
            name = form.cleaned_data["priority_class"]
            self._each(
                request,
                queryset,
                f"moved to class {name}",
                lambda pk: services.set_priority_class(pk, name, by=by),
            )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Change the priority class",
            "opts": self.model._meta,
            "form": form,
            "jobs": queryset.select_related("owner"),
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action": "change_priority",
        }
        return TemplateResponse(
            request, "admin/scheduler/job/change_priority.html", context
        )


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin[Attempt]):
    list_display = (
        "job",
        "number",
        "node",
        "started_at",
        "ended_at",
        "outcome",
        "exit_code",
    )
    list_filter = ("outcome", "node")
    readonly_fields = tuple(f.name for f in Attempt._meta.fields)


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdmin[Allocation]):
    list_display = ("attempt", "gpu", "slot", "allocated_at", "released_at")
    readonly_fields = tuple(f.name for f in Allocation._meta.fields)


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyAdmin[JobEvent]):
    """Every job's history, written by the services only."""

    list_display = ("job", "at", "source", "from_status", "to_status", "message")
    list_filter = ("source",)


@admin.register(JobLogChunk)
class JobLogChunkAdmin(ReadOnlyAdmin[JobLogChunk]):
    list_display = ("attempt", "offset")


@admin.register(ProgressSample)
class ProgressSampleAdmin(ReadOnlyAdmin[ProgressSample]):
    list_display = ("attempt", "at", "step")
    list_select_related = ("attempt",)
    readonly_fields = tuple(f.name for f in ProgressSample._meta.fields)
