"""The console's view of the charging ledger."""

from __future__ import annotations

from django.contrib import admin

from portal.admin.common import ReadOnlyAdmin
from scheduler.models import UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin[UsageRecord]):
    """The charging ledger, written by the accounting only."""

    list_display = (
        "attempt",
        "gpu",
        "user",
        "group",
        "started_at",
        "ended_at",
        "gpu_seconds",
        "lost_gpu_seconds",
    )
    list_filter = ("group",)
