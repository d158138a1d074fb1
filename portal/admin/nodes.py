"""The console's nodes and GPUs: each node's live state and the admin's verbs on
it (register, drain, maintenance, resume, rotate the agent token), each behind
its permission; a GPU's slots. Every write that changes scheduling goes through
``scheduler.services`` (``create_node``, ``set_node_mode``,
``rotate_node_token``, ``set_gpu_slots``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import LogEntry
from django.contrib.admin.options import get_content_type_for_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import OuterRef
from django.utils.html import format_html_join

from portal.admin.common import acting_user, count_subquery, report_action
from scheduler import services
from scheduler.models import Allocation, Gpu, Node

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest


class GpuInline(admin.TabularInline[Gpu, Node]):
    """The node's GPUs as its agent reported them, read only: a GPU's slots are
    changed on its own page (the link), through ``services.set_gpu_slots``."""

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
    readonly_fields = fields
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class NodeForm(forms.ModelForm[Node]):
    """The node's name, checked as ``services.create_node`` checks it when it
    is given or changed."""

    class Meta:
        model = Node
        fields = ("name",)

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if "name" in cleaned and "name" in self.changed_data:
            try:
                cleaned["name"] = services.check_node_name(cleaned["name"])
            except ValidationError as exc:
                self.add_error(None, exc)
        return cleaned


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin[Node]):
    """Nodes with their live state (status, drain / maintenance, connection, GPUs
    busy of present, jobs running, last heartbeat) and the admin's verbs on them,
    each behind its permission (``drain_node``, ``rotate_node_token``). A node
    added here is registered by ``services.create_node``, and its agent token
    shown once."""

    form = NodeForm

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
                n_gpus=count_subquery(present, "node", "pk"),
                n_busy=count_subquery(live, "gpu__node", "gpu"),
                n_running=count_subquery(live, "gpu__node", "attempt__job"),
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
        """A new node through ``services.create_node`` (its token made and
        stored hashed there, shown once here); a registered one's name as
        edited (``name`` is its only editable field)."""
        if change:
            super().save_model(request, obj, form, change)
            return
        try:
            node, token = services.create_node(obj.name)
        except ValidationError as exc:  # the name was taken since the form's check
            raise PermissionDenied(" ".join(exc.messages)) from exc
        # The admin's history entry and redirect use ``obj``: make it the new row.
        for field in Node._meta.concrete_fields:
            setattr(obj, field.attname, getattr(node, field.attname))
        obj._state.adding = False
        obj._state.db = node._state.db
        self.message_user(
            request,
            f"Node {obj.name} registered. Its agent token (shown once): {token}",
            messages.WARNING,
        )

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
        by = acting_user(request)
        for node in queryset.order_by("name"):
            # the service checks drain_node and writes the node's history
            if services.set_node_mode(node.pk, mode, by=by):
                done += 1
            else:
                skipped.append(f"{node.name} {already}.")
        report_action(self, request, verb, done, skipped)

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


class GpuSlotsForm(forms.ModelForm[Gpu]):
    """A GPU's slots, checked as ``services.set_gpu_slots`` checks them (from 1
    to the maximum; not below what running jobs hold, named)."""

    class Meta:
        model = Gpu
        fields = ("slots",)

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if "slots" in cleaned and "slots" in self.changed_data:
            try:
                services.check_gpu_slots(self.instance, cleaned["slots"])
            except ValidationError as exc:
                self.add_error(None, exc)
        return cleaned


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin[Gpu]):
    """GPUs as their agents report them (read only; a GPU is added by its node's
    hello and never deleted here); ``slots``, how many jobs may share it, is the
    admin's setting, written by ``services.set_gpu_slots`` (locked, checked
    again, the GPU's history, a pass)."""

    form = GpuSlotsForm

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
    readonly_fields = tuple(f.name for f in Gpu._meta.fields if f.name != "slots")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: Gpu | None = None
    ) -> bool:
        return False

    def save_model(
        self,
        request: HttpRequest,
        obj: Gpu,
        form: GpuSlotsForm,
        change: bool,  # noqa: FBT001 - Django's signature
    ) -> None:
        """Through the service: it locks the GPU and checks the value again (a
        job that took a slot since the form's check: 403, nothing changed)."""
        if "slots" not in form.changed_data:
            return
        try:
            services.set_gpu_slots(
                obj.pk, form.cleaned_data["slots"], by=acting_user(request)
            )
        except ValidationError as exc:
            raise PermissionDenied(" ".join(exc.messages)) from exc

    def log_change(self, request: HttpRequest, obj: Gpu, message: Any) -> LogEntry:
        """Writes nothing more: the GPU's history entry ("slots 2 -> 4") was
        written by ``services.set_gpu_slots`` in its transaction, and Django's
        own ("Changed slots.") would say it twice; a POST that changed nothing
        adds nothing either. Returns the GPU's latest entry (Django's when it
        has none)."""
        entry = (
            LogEntry.objects.filter(
                content_type=get_content_type_for_model(obj), object_id=str(obj.pk)
            )
            .order_by("-pk")
            .first()
        )
        return entry if entry is not None else super().log_change(request, obj, message)
