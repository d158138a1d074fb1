"""The admin overview (staff only): usage per group this month, cluster
utilisation and idle GPU-hours per day over the last 30 days, the jobs flagged
idle now, nodes needing attention (figures from ``portal.overview``), and the
scheduling passes' statistics (``scheduler.pass_log``, like Slurm's ``sdiag``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import redis
from django.conf import settings
from django.contrib import admin
from django.shortcuts import render
from django.utils import timezone

from portal import overview
from portal.accounting import hours, live
from portal.admin_site import staff_required
from portal.quotas.models import Quota
from portal.quotas.usage import quota_states
from scheduler import pass_log

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse


def quotas_by_group(
    group_ids: list[int], now: datetime, charges: live.LiveCharges
) -> dict[int, str]:
    """Each group's use of its quota in the quota's current period, as text
    ("12.0 of 100.0 GPU-h (month, 12 %)", and its concurrent-GPU cap): one query
    for the quotas, one for their usage (``portal.quotas.usage``, with the
    running attempts' charges the page loaded once)."""
    out: dict[int, str] = {}
    for state in quota_states(
        now,
        quotas=Quota.objects.filter(group_id__in=group_ids).select_related(
            "group", "user"
        ),
        live_charges=charges,
    ):
        q = state.quota
        parts = []
        if state.limit_gpu_hours is not None:
            parts.append(
                f"{state.used_gpu_hours:.1f} of {state.limit_gpu_hours:.1f} GPU-h"
                f" ({q.period_label}, {state.percent or 0:.0f} %)"
            )
        if q.max_gpus is not None:
            parts.append(f"{state.running_gpus} of {q.max_gpus} GPUs at once")
        if q.group_id is not None:
            out[q.group_id] = f"{'; '.join(parts)} [{'hard' if q.hard else 'soft'}]"
    return out


# How many of the kept passes the page lists (newest first).
PASSES_SHOWN = 20


def pass_statistics() -> dict[str, Any]:
    """The last passes (``PASSES_SHOWN``; start as a datetime, times in ms) and
    the totals since they began; with Redis unreachable, ``unavailable`` says so and
    the rest of the page still shows."""
    try:
        records, totals = pass_log.recent(PASSES_SHOWN), pass_log.totals()
    except redis.RedisError as exc:
        return {"unavailable": repr(exc)}
    return {
        "recent": [
            {
                "at": datetime.fromtimestamp(r.at, tz=UTC),
                "record": r,
                "ms": {
                    "total": r.total_s * 1000,
                    "load": r.load_s * 1000,
                    "decide": r.decide_s * 1000,
                    "apply": r.apply_s * 1000,
                },
                "stages_ms": [(name, s * 1000) for name, s in r.stage_s.items()],
            }
            for r in records
        ],
        "totals": totals,
        "since": None
        if totals.since is None
        else datetime.fromtimestamp(totals.since, tz=UTC),
        "slow_s": settings.GPULAB_PASS_SLOW_S,
    }


@staff_required
def admin_overview(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    since = overview.month_start(now)
    charges = live.load(now)  # running jobs, for group usage and quotas alike
    usage = overview.group_usage(since, now, charges)
    quotas = quotas_by_group([u.group_id for u in usage], now, charges)
    days = overview.daily_figures(now)
    series = {
        "days": [d.day.isoformat() for d in days],
        "allocated": [d.allocated_percent for d in days],
        "util": [d.util_percent for d in days],
        "idle": [
            None if d.idle_hours is None else round(d.idle_hours, 2) for d in days
        ],
    }
    context = {
        **admin.site.each_context(request),
        "title": "Cluster overview",
        "since": since,
        "usage": [(u, quotas.get(u.group_id, "")) for u in usage],
        "total_hours": sum(u.hours for u in usage),
        "lost_hours": sum(u.lost_hours for u in usage),
        "days": days,
        "idle_total": sum(d.idle_hours or 0.0 for d in days),
        "idle_unknown": sum(1 for d in days if d.idle_hours is None),
        "idle_threshold": settings.GPULAB_IDLE_THRESHOLD,
        "idle_flags": list(overview.idle_flags()),
        "through": hours.through(),
        "series": series,
        "nodes": list(overview.nodes_needing_attention()),
        "passes": pass_statistics(),
    }
    return render(request, "admin/overview.html", context)
