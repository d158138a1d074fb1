from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import Exists, OuterRef

from portal.idle.models import IdleFlag

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest

    from scheduler.models import Job


class IdleJobFilter(admin.SimpleListFilter):
    """The admin job list's "idle" filter: jobs flagged idle now (or ever)."""

    title = "idle GPUs"
    parameter_name = "idle"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("now", "idle now"), ("ever", "flagged idle at some time")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        flags = IdleFlag.objects.filter(job=OuterRef("pk"))
        if self.value() == "now":
            return queryset.filter(Exists(flags.filter(cleared_at__isnull=True)))
        if self.value() == "ever":
            return queryset.filter(Exists(flags))
        return queryset


@admin.register(IdleFlag)
class IdleFlagAdmin(admin.ModelAdmin[IdleFlag]):
    list_display = (
        "job",
        "since",
        "flagged_at",
        "util_max",
        "memory_mib",
        "action",
        "cancel_at",
        "cleared",
    )
    list_filter = ("action", "cleared")
    readonly_fields = tuple(f.name for f in IdleFlag._meta.fields)
