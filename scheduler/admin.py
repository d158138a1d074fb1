"""The admin console: every model; nodes with their live state and the drain /
maintenance / resume / rotate-token verbs; jobs with cancel, requeue, priority
class, hold and release; groups with their memberships. Every action checks its
own permission (``has_<perm>_permission``) and reports per object."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db.models import Count, OuterRef, Prefetch, Subquery, Value
from django.db.models.functions import Coalesce
from django.template.response import TemplateResponse
from django.utils.html import format_html_join

from portal.idle.admin import IdleJobFilter
from scheduler import classes, services
from scheduler.models import (
    Allocation,
    Attempt,
    Gpu,
    Group,
    InterferencePair,
    Job,
    JobEvent,
    JobLogChunk,
    Membership,
    Node,
    Profile,
    ProgressSample,
    UsageRecord,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.db.models import QuerySet
    from django.http import HttpRequest


def _acting_user(request: HttpRequest) -> User:
    """The admin behind a console action (the admin site admits only staff)."""
    assert isinstance(request.user, User)
    return request.user


def _report(
    modeladmin: admin.ModelAdmin[Any],
    request: HttpRequest,
    verb: str,
    done: int,
    skipped: list[str],
) -> None:
    """One message per action with the result for every object, e.g.
    "3 held, 1 skipped: Job #5 is running; only a pending job can be held."."""
    text = f"{done} {verb}"
    if skipped:
        text += f", {len(skipped)} skipped: " + " ".join(skipped)
    level = messages.SUCCESS
    if skipped:
        level = messages.WARNING if done else messages.ERROR
    modeladmin.message_user(request, text, level)


def _count(queryset: QuerySet[Any], key: str, field: str) -> Coalesce:
    """COUNT(DISTINCT field) of a queryset filtered on OuterRef, as a subquery."""
    rows = queryset.order_by().values(key).annotate(n=Count(field, distinct=True))
    return Coalesce(Subquery(rows.values("n")[:1]), Value(0))


class MembershipInline(admin.TabularInline[Membership, Group]):
    model = Membership
    extra = 1
    autocomplete_fields = ("user",)
    fields = ("user", "shares", "is_leader", "joined_at")


@admin.register(Group)
class GroupAdmin(admin.ModelAdmin[Group]):
    """Lab groups with their memberships inline (shares, leader flag)."""

    list_display = ("name", "description", "shares", "members", "leaders")
    search_fields = ("name",)
    inlines = (MembershipInline,)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Group]:
        leaders = Membership.objects.filter(is_leader=True).select_related("user")
        return (
            super()
            .get_queryset(request)
            .annotate(member_count=Count("membership"))
            .prefetch_related(
                Prefetch("membership_set", queryset=leaders, to_attr="leader_rows")
            )
        )

    @admin.display(description="members", ordering="member_count")
    def members(self, obj: Group) -> int:
        return int(getattr(obj, "member_count", 0))

    @admin.display(description="leaders")
    def leaders(self, obj: Group) -> str:
        rows = getattr(obj, "leader_rows", [])
        return ", ".join(m.user.get_username() for m in rows) or "\u2013"


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin[Membership]):
    list_display = ("user", "group", "shares", "is_leader", "joined_at")
    list_filter = ("group", "is_leader")
    list_select_related = ("user", "group")
    search_fields = ("user__username", "group__name")
    autocomplete_fields = ("user",)


class GpuInline(admin.TabularInline[Gpu, Node]):
    model = Gpu
    extra = 0
    fields = (
        "index",
        "name",
        "uuid",
        "memory_total_mib",
        "slots",
        "present",
        "mig_enabled",
    )
    readonly_fields = (
        "index",
        "name",
        "uuid",
        "memory_total_mib",
        "present",
        "mig_enabled",
    )
    can_delete = False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin[Node]):
    """Nodes with their live state (status, drain / maintenance, connection, GPUs
    busy of present, jobs running, last heartbeat) and the admin's verbs on them,
    each behind its permission (``drain_node``, ``rotate_node_token``)."""

    list_display = (
        "name",
        "state",
        "connected",
        "gpus_busy",
        "running_jobs",
        "last_seen_at",
        "hostname",
    )
    list_filter = ("status", "maintenance", "draining", "connected")
    search_fields = ("name", "hostname")
    readonly_fields = (
        "status",
        "draining",
        "maintenance",
        "connected",
        "last_seen_at",
        "hostname",
        "driver_version",
        "cuda_version",
        "agent_version",
        "incarnation",
        "created_at",
    )
    inlines = (GpuInline,)
    actions = ("drain", "maintenance", "resume", "rotate_token")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Node]:
        live = Allocation.objects.filter(
            gpu__node=OuterRef("pk"), released_at__isnull=True
        )
        present = Gpu.objects.filter(node=OuterRef("pk"), present=True)
        return (
            super()
            .get_queryset(request)
            .annotate(
                n_gpus=_count(present, "node", "pk"),
                n_busy=_count(live, "gpu__node", "gpu"),
                n_running=_count(live, "gpu__node", "attempt__job"),
            )
        )

    @admin.display(description="state", ordering="status")
    def state(self, obj: Node) -> str:
        parts = [obj.get_status_display()]
        if obj.mode:
            parts.append(obj.mode)
        return format_html_join(
            " ",
            '<span class="node-state {}">{}</span>',
            ((part.replace(" ", "-"), part) for part in parts),
        )

    @admin.display(description="GPUs busy", ordering="n_busy")
    def gpus_busy(self, obj: Node) -> str:
        return f"{getattr(obj, 'n_busy', 0)} / {getattr(obj, 'n_gpus', 0)}"

    @admin.display(description="jobs running", ordering="n_running")
    def running_jobs(self, obj: Node) -> int:
        return int(getattr(obj, "n_running", 0))

    def has_drain_node_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("scheduler.drain_node")

    def has_rotate_node_token_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("scheduler.rotate_node_token")

    def save_model(
        self,
        request: HttpRequest,
        obj: Node,
        form: Any,
        change: bool,  # noqa: FBT001 - Django's signature
    ) -> None:
        if not change:
            token = Node.new_token()
            obj.set_token(token)
            super().save_model(request, obj, form, change)
            self.message_user(
                request,
                f"Node {obj.name} registered. Its agent token (shown once): {token}",
                messages.WARNING,
            )
            return
        super().save_model(request, obj, form, change)

    @admin.action(
        description="Rotate the agent token (shows the new one once)",
        permissions=["rotate_node_token"],
    )
    def rotate_token(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        for node in queryset:
            token = services.rotate_node_token(node.pk)
            self.log_change(request, node, "rotated the agent token")
            self.message_user(
                request,
                f"New token for {node.name} (shown once): {token}",
                messages.WARNING,
            )

    def _set_mode(
        self,
        request: HttpRequest,
        queryset: QuerySet[Node],
        mode: services.NodeMode,
        verb: str,
        already: str,
    ) -> None:
        done, skipped = 0, []
        by = _acting_user(request)
        for node in queryset.order_by("name"):
            # the service checks drain_node and writes the node's history
            if services.set_node_mode(node.pk, mode, by=by):
                done += 1
            else:
                skipped.append(f"{node.name} {already}.")
        _report(self, request, verb, done, skipped)

    @admin.action(
        description="Drain: take no new jobs (running ones finish)",
        permissions=["drain_node"],
    )
    def drain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set_mode(request, queryset, "drain", "drained", "was already draining")

    @admin.action(
        description="Mark in maintenance: take no new jobs (running ones finish)",
        permissions=["drain_node"],
    )
    def maintenance(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set_mode(
            request,
            queryset,
            "maintenance",
            "put in maintenance",
            "was already in maintenance",
        )

    @admin.action(
        description="Resume: take new jobs again (ends drain and maintenance)",
        permissions=["drain_node"],
    )
    def resume(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set_mode(request, queryset, "resume", "resumed", "was taking jobs")


@admin.register(InterferencePair)
class InterferencePairAdmin(admin.ModelAdmin[InterferencePair]):
    """The co-location model's learned table: what each ordered pair of workloads
    showed when they shared a GPU. Reset forgets a pair (observations and harmful
    mark); each reset is in the admin's history (who, when)."""

    list_display = (
        "workload_a",
        "workload_b",
        "n",
        "observed_slowdown",
        "harmful",
        "updated_at",
        "reset_at",
        "reset_by",
    )
    list_filter = ("harmful",)
    search_fields = ("workload_a", "workload_b")
    readonly_fields = (
        "workload_a",
        "workload_b",
        "n",
        "mean_log",
        "m2",
        "harmful",
        "harmful_reason",
        "updated_at",
        "reset_at",
        "reset_by",
    )
    actions = ("reset",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description="slowdown (observed)")
    def observed_slowdown(self, obj: InterferencePair) -> str:
        return "\u2013" if obj.slowdown is None else f"{obj.slowdown:.2f}x"

    @admin.action(description="Reset: forget what was learned about these pairs")
    def reset(self, request: HttpRequest, queryset: QuerySet[InterferencePair]) -> None:
        pairs = list(queryset)
        n = services.reset_interference_pairs(
            [p.pk for p in pairs], getattr(request.user, "pk", None)
        )
        for pair in pairs:
            self.log_change(
                request,
                pair,
                f"reset (was n={pair.n}, slowdown {pair.slowdown or 0:.2f}x,"
                f" harmful={pair.harmful})",
            )
        self.message_user(request, f"{n} pair(s) reset.", messages.SUCCESS)


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin[Gpu]):
    list_display = (
        "node",
        "index",
        "name",
        "memory_total_mib",
        "slots",
        "present",
        "latest_at",
    )
    list_filter = ("node", "name", "present")
    readonly_fields = ("latest", "latest_at")


class JobEventInline(admin.TabularInline[JobEvent, Job]):
    model = JobEvent
    extra = 0
    can_delete = False
    readonly_fields = ("at", "source", "actor", "from_status", "to_status", "message")


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
    here (submit from the portal; deleting would lose their usage)."""

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
        _report(self, request, verb, done, skipped)

    @admin.action(description="Cancel", permissions=["cancel_any_job"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = _acting_user(request)
        self._each(
            request, queryset, "cancelled", lambda pk: services.cancel_job(pk, by=by)
        )

    @admin.action(
        description="Requeue: stop and send back to the queue (age kept)",
        permissions=["requeue_job"],
    )
    def requeue_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = _acting_user(request)
        self._each(
            request, queryset, "requeued", lambda pk: services.requeue_job(pk, by=by)
        )

    @admin.action(description="Hold: keep from starting", permissions=["hold_job"])
    def hold_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = _acting_user(request)
        self._each(request, queryset, "held", lambda pk: services.hold_job(pk, by=by))

    @admin.action(description="Release a hold", permissions=["hold_job"])
    def release_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        by = _acting_user(request)
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
            by = _acting_user(request)
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
class AttemptAdmin(admin.ModelAdmin[Attempt]):
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
class AllocationAdmin(admin.ModelAdmin[Allocation]):
    list_display = ("attempt", "gpu", "slot", "allocated_at", "released_at")
    readonly_fields = tuple(f.name for f in Allocation._meta.fields)


@admin.register(JobEvent)
class JobEventAdmin(admin.ModelAdmin[JobEvent]):
    list_display = ("job", "at", "source", "from_status", "to_status", "message")
    list_filter = ("source",)


@admin.register(JobLogChunk)
class JobLogChunkAdmin(admin.ModelAdmin[JobLogChunk]):
    list_display = ("attempt", "offset")


@admin.register(ProgressSample)
class ProgressSampleAdmin(admin.ModelAdmin[ProgressSample]):
    list_display = ("attempt", "at", "step")
    list_select_related = ("attempt",)
    readonly_fields = tuple(f.name for f in ProgressSample._meta.fields)


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin[UsageRecord]):
    list_display = (
        "attempt",
        "gpu",
        "user",
        "group",
        "started_at",
        "ended_at",
        "gpu_seconds",
    )
    list_filter = ("group",)


class ProfileInline(admin.StackedInline[Profile, User]):
    model = Profile
    can_delete = False
    verbose_name_plural = "gpulab profile"


class MembershipOfUserInline(admin.TabularInline[Membership, User]):
    model = Membership
    extra = 0
    fields = ("group", "shares", "is_leader", "joined_at")
    verbose_name_plural = "lab groups"


class GpulabUserAdmin(UserAdmin[User]):
    """Django's user admin plus the Unix account, primary group and lab groups of
    the user."""

    inlines = (ProfileInline, MembershipOfUserInline)
    list_display = (
        "username",
        "email",
        "first_name",
        "last_name",
        "is_staff",
        "primary_group",
    )
    list_filter = (
        "is_staff",
        "is_superuser",
        "is_active",
        "groups",
        "gpulab__primary_group",
    )
    list_select_related = ("gpulab__primary_group",)

    @admin.display(description="primary group", ordering="gpulab__primary_group")
    def primary_group(self, obj: User) -> str:
        try:
            profile = obj.gpulab
        except Profile.DoesNotExist:
            return "\u2013"
        group = profile.primary_group
        return group.name if group is not None else "\u2013"


admin.site.unregister(User)
admin.site.register(User, GpulabUserAdmin)


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin[Profile]):
    list_display = ("user", "unix_account", "primary_group")
    list_select_related = ("user", "primary_group")
    search_fields = ("user__username", "unix_account")
