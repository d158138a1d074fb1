"""The admin console's quotas (list with used / limit / period end, edits through
``services`` so every change lands in the audit log), their alerts, and the audit
log itself (read-only)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.utils.html import format_html, format_html_join

from portal.quotas import services
from portal.quotas.models import AuditEntry, Quota, QuotaAlert
from portal.quotas.usage import QuotaState, quota_states

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest


_ATTR = "quota_state"  # where the changelist leaves each listed quota's state


class QuotaChangeList(ChangeList):
    """Computes the listed quotas' states in one go (two queries for the page)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        quotas = list(self.result_list)
        states = {s.quota.pk: s for s in quota_states(quotas=quotas)}
        for q in quotas:
            setattr(q, _ATTR, states.get(q.pk))


def _state(obj: Quota) -> QuotaState | None:
    """The quota's state, from the changelist's batch, else read for it alone."""
    got: QuotaState | None = getattr(obj, _ATTR, None)
    if got is None and obj.pk is not None:
        [got] = quota_states(quotas=[obj])
        setattr(obj, _ATTR, got)
    return got


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin[Quota]):
    list_display = (
        "target",
        "kind",
        "period_label",
        "used",
        "limit",
        "percent",
        "gpus",
        "period_end",
        "note",
    )
    list_filter = ("hard", "period")
    search_fields = ("group__name", "user__username", "note")
    autocomplete_fields = ("group", "user")
    list_select_related = ("group", "user")
    readonly_fields = ("used_now", "created_at", "updated_at")
    fields = (
        "group",
        "user",
        "gpu_hours",
        "period",
        "period_days",
        "anchor",
        "max_gpus",
        "hard",
        "note",
        "used_now",
        "created_at",
        "updated_at",
    )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return QuotaChangeList

    @admin.display(description="hard / soft")
    def kind(self, obj: Quota) -> str:
        return "hard" if obj.hard else "soft"

    @admin.display(description="period")
    def period_label(self, obj: Quota) -> str:
        return obj.period_label

    @admin.display(description="used (GPU-h)")
    def used(self, obj: Quota) -> str:
        state = _state(obj)
        return "-" if state is None else f"{state.used_gpu_hours:,.1f}"

    @admin.display(description="limit (GPU-h)")
    def limit(self, obj: Quota) -> str:
        return "-" if obj.gpu_hours is None else f"{obj.gpu_hours:,.1f}"

    @admin.display(description="used %")
    def percent(self, obj: Quota) -> str:
        state = _state(obj)
        if state is None or state.percent is None:
            return "-"
        return f"{state.percent:.0f} %"

    @admin.display(description="GPUs held / cap")
    def gpus(self, obj: Quota) -> str:
        state = _state(obj)
        held = 0 if state is None else state.running_gpus
        return f"{held} / {'-' if obj.max_gpus is None else obj.max_gpus}"

    @admin.display(description="period ends")
    def period_end(self, obj: Quota) -> str:
        state = _state(obj)
        return "-" if state is None else f"{state.period_end:%Y-%m-%d %H:%M %Z}"

    @admin.display(description="this period")
    def used_now(self, obj: Quota) -> str:
        state = _state(obj)
        if state is None:
            return "-"
        limit = state.limit_gpu_hours
        of = "" if limit is None else f" of {limit:,.1f}"
        return (
            f"{state.used_gpu_hours:,.1f}{of} GPU-hours used"
            f" ({state.running_gpu_hours:,.1f} by running jobs) from"
            f" {state.period_start:%Y-%m-%d %H:%M} to"
            f" {state.period_end:%Y-%m-%d %H:%M %Z}; {state.running_gpus} GPUs held"
        )

    def save_model(
        self,
        request: HttpRequest,
        obj: Quota,
        form: Any,
        change: bool,  # noqa: FBT001 - Django's signature
    ) -> None:
        services.save_quota(obj, by=request.user, via="admin")

    def delete_model(self, request: HttpRequest, obj: Quota) -> None:
        services.delete_quota(obj.pk, by=request.user, via="admin")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Quota]) -> None:
        for pk in queryset.values_list("pk", flat=True):
            services.delete_quota(pk, by=request.user, via="admin")


class _ReadOnly:
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(QuotaAlert)
class QuotaAlertAdmin(_ReadOnly, admin.ModelAdmin[QuotaAlert]):
    list_display = (
        "quota",
        "threshold",
        "period_start",
        "used_gpu_hours",
        "limit_gpu_hours",
        "created_at",
    )
    list_filter = ("threshold",)
    list_select_related = ("quota__group", "quota__user")


@admin.register(AuditEntry)
class AuditEntryAdmin(_ReadOnly, admin.ModelAdmin[AuditEntry]):
    """Read-only: entries are written by the service verbs, never edited."""

    list_display = ("at", "actor_name", "action", "object_type", "object_repr", "via")
    list_filter = ("action", "object_type", "via")
    search_fields = ("actor_name", "object_repr")
    date_hierarchy = "at"
    fields = (
        "at",
        "actor_name",
        "action",
        "object_type",
        "object_id",
        "object_repr",
        "via",
        "changes",
    )
    readonly_fields = fields

    @admin.display(description="changes (old -> new)")
    def changes(self, obj: AuditEntry) -> str:
        old, new = obj.old or {}, obj.new or {}
        keys = [k for k in {**old, **new} if old.get(k) != new.get(k)]
        if not keys:
            return "-"
        return format_html(
            "<table>{}</table>",
            format_html_join(
                "",
                "<tr><th>{}</th><td>{}</td><td>&rarr;</td><td>{}</td></tr>",
                (
                    (
                        k,
                        json.dumps(old.get(k)) if k in old else "",
                        json.dumps(new.get(k)) if k in new else "",
                    )
                    for k in keys
                ),
            ),
        )
