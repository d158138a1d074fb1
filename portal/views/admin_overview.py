"""The admin overview (staff only): usage per group this month, cluster
utilisation and idle GPU-hours per day over the last 30 days, nodes needing
attention. Figures from ``scheduler.overview`` (SQL aggregates)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.shortcuts import render
from django.utils import timezone

from scheduler import overview

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse


def quotas_by_group(group_ids: list[int]) -> dict[int, str]:
    """Each group's usage against its quota, as text ("12 of 100 GPU-h (12 %)").

    MERGE (issue 6, quotas): the quotas are built in ``portal/quotas`` by another
    part of issue 6; wire its per-group reading here. Until then no group has a
    quota and the column says so.
    """
    return {}


@staff_member_required
def admin_overview(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    since = overview.month_start(now)
    usage = overview.group_usage(since, now)
    quotas = quotas_by_group([u.group_id for u in usage])
    days = overview.daily_figures(now)
    series = {
        "days": [d.day.isoformat() for d in days],
        "allocated": [d.allocated_percent for d in days],
        "util": [d.util_percent for d in days],
        "idle": [round(d.idle_hours, 2) for d in days],
    }
    context = {
        **admin.site.each_context(request),
        "title": "Cluster overview",
        "since": since,
        "usage": [(u, quotas.get(u.group_id, "")) for u in usage],
        "total_hours": sum(u.hours for u in usage),
        "days": days,
        "idle_total": sum(d.idle_hours for d in days),
        "idle_threshold": overview.IDLE_UTIL_PERCENT,
        "series": series,
        "nodes": list(overview.nodes_needing_attention()),
    }
    return render(request, "admin/overview.html", context)
