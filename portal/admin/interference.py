"""The console's view of what co-location learned about pairs of workloads, with
the reset that forgets a pair."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin, messages

from scheduler import services
from scheduler.models import InterferencePair

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest


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
