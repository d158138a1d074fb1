"""The admin console: every model, with node token rotation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.models import User

from portal.idle.admin import IdleJobFilter
from scheduler import services
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
    from django.db.models import QuerySet
    from django.http import HttpRequest


class MembershipInline(admin.TabularInline[Membership, Group]):
    model = Membership
    extra = 1
    autocomplete_fields = ("user",)


@admin.register(Group)
class GroupAdmin(admin.ModelAdmin[Group]):
    list_display = ("name", "description", "shares")
    search_fields = ("name",)
    inlines = (MembershipInline,)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin[Membership]):
    list_display = ("user", "group", "shares", "joined_at")
    list_filter = ("group",)


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
    list_display = (
        "name",
        "status",
        "draining",
        "connected",
        "last_seen_at",
        "hostname",
    )
    list_filter = ("status", "draining")
    search_fields = ("name", "hostname")
    readonly_fields = (
        "status",
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
    actions = ("rotate_token", "drain", "resume")

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

    @admin.action(description="Rotate the agent token (shows the new one once)")
    def rotate_token(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        for node in queryset:
            token = services.rotate_node_token(node.pk)
            self.message_user(
                request,
                f"New token for {node.name} (shown once): {token}",
                messages.WARNING,
            )

    @admin.action(description="Drain: take no new jobs")
    def drain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        for node in queryset:
            services.set_draining(node.pk, draining=True)

    @admin.action(description="Resume: take new jobs again")
    def resume(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        for node in queryset:
            services.set_draining(node.pk, draining=False)


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


@admin.register(Job)
class JobAdmin(admin.ModelAdmin[Job]):
    list_display = (
        "id",
        "name",
        "owner",
        "group",
        "status",
        "gpus",
        "priority_class",
        "submitted_at",
    )
    list_filter = ("status", "priority_class", "group", IdleJobFilter)
    search_fields = ("name", "owner__username", "command")
    # State is changed only through scheduler.services (cancel from the job page).
    readonly_fields = (
        "status",
        "pending_reason",
        "pending_message",
        "cancel_requested_at",
        "attempts",
        "exit_code",
        "end_reason",
        "submitted_at",
        "started_at",
        "finished_at",
    )
    inlines = (JobEventInline,)


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
    verbose_name_plural = "lab groups"


class GpulabUserAdmin(UserAdmin[User]):
    """Django's user admin plus the Unix account and the lab groups of the user."""

    inlines = (ProfileInline, MembershipOfUserInline)


admin.site.unregister(User)
admin.site.register(User, GpulabUserAdmin)


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin[Profile]):
    list_display = ("user", "unix_account")
    search_fields = ("user__username", "unix_account")
