"""Quotas, their alerts and the audit log.

Only ``portal.quotas.services`` writes ``Quota`` (and records each change in
``AuditEntry``); the scheduling pass writes ``QuotaAlert`` (``alerts.record_alerts``).
"""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, ClassVar
from zoneinfo import ZoneInfo

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from scheduler.models import Group


def _today() -> date:
    return timezone.localdate()


class QuotaQuerySet(models.QuerySet["Quota"]):
    def for_user(self, user: Any) -> QuotaQuerySet:
        """The quotas ``user``'s jobs are subject to: their own and those of their
        groups (a job is charged to one of them)."""
        if not user.is_authenticated:
            return self.none()
        return (
            self.filter(Q(user=user) | Q(group__membership__user=user))
            .select_related("group", "user")
            .distinct()
        )


class Quota(models.Model):
    """A group's or a user's quota: GPU-hours per period and/or a cap on the GPUs
    its jobs hold at once.

    A job is subject to its owner's quota and to the quota of the group it is
    charged to. Hard: a job stays PENDING ("quota exhausted") once the period's
    GPU-hours are used up; soft: its priority is lowered instead. The concurrent
    cap always holds. Periods start at midnight in ``TIME_ZONE``: each calendar
    month, each week (Monday), or every ``period_days`` days from ``anchor``;
    usage counts from the current period's start (a reset at each start).
    """

    class Period(models.TextChoices):
        MONTH = "month", "calendar month"
        WEEK = "week", "week (from Monday)"
        DAYS = "days", "every N days from the anchor date"

    group = models.ForeignKey(
        Group, null=True, blank=True, on_delete=models.CASCADE, related_name="quotas"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="quotas",
    )
    gpu_hours = models.DecimalField(
        "GPU-hours per period",
        max_digits=12,
        decimal_places=3,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Empty: no GPU-hour limit.",
    )
    period = models.CharField(
        max_length=8, choices=Period.choices, default=Period.MONTH
    )
    period_days = models.PositiveIntegerField(
        "days per period",
        null=True,
        blank=True,
        help_text="Only for 'every N days'.",
    )
    anchor = models.DateField(
        default=_today, help_text="'Every N days' periods start on this date."
    )
    max_gpus = models.PositiveIntegerField(
        "max concurrent GPUs",
        null=True,
        blank=True,
        help_text="Empty: no cap. Always enforced, hard or soft.",
    )
    hard = models.BooleanField(
        default=True,
        help_text="Hard: jobs wait once the GPU-hours are used up. Soft: their"
        " priority is lowered instead.",
    )
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = QuotaQuerySet.as_manager()

    class Meta:
        ordering = ("group__name", "user__username")
        constraints: ClassVar = [
            models.CheckConstraint(
                condition=Q(group__isnull=False, user__isnull=True)
                | Q(group__isnull=True, user__isnull=False),
                name="%(app_label)s_%(class)s_group_xor_user",
                violation_error_message="A quota is for a group or for a user:"
                " set exactly one of them.",
            ),
            models.CheckConstraint(
                condition=Q(gpu_hours__isnull=False) | Q(max_gpus__isnull=False),
                name="%(app_label)s_%(class)s_some_limit",
                violation_error_message="Set GPU-hours, a GPU cap, or both.",
            ),
            models.CheckConstraint(
                condition=Q(gpu_hours__isnull=True) | Q(gpu_hours__gte=0),
                name="%(app_label)s_%(class)s_hours_non_negative",
                violation_error_message="GPU-hours cannot be negative.",
            ),
            models.CheckConstraint(
                condition=~Q(period="days") | Q(period_days__gte=1),
                name="%(app_label)s_%(class)s_days_set",
                violation_error_message="'Every N days' needs N of at least 1.",
            ),
            models.UniqueConstraint(
                fields=["group"],
                condition=Q(group__isnull=False),
                name="%(app_label)s_%(class)s_one_per_group",
                violation_error_message="This group already has a quota.",
            ),
            models.UniqueConstraint(
                fields=["user"],
                condition=Q(user__isnull=False),
                name="%(app_label)s_%(class)s_one_per_user",
                violation_error_message="This user already has a quota.",
            ),
        ]

    def __str__(self) -> str:
        return f"quota of {self.target}"

    @property
    def target(self) -> str:
        if self.group_id is not None:
            return f"group {self.group}"
        return f"user {self.user}"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.group_id is None and self.user_id is None:
            errors["group"] = "Choose a group or a user."
        elif self.group_id is not None and self.user_id is not None:
            errors["user"] = (
                "A quota is for a group or for a user, not both: clear one of them."
            )
        if self.gpu_hours is None and self.max_gpus is None:
            errors["gpu_hours"] = (
                "Set GPU-hours, a GPU cap (max concurrent GPUs), or both."
            )
        elif self.gpu_hours is not None and self.gpu_hours < 0:
            errors["gpu_hours"] = (
                f"GPU-hours cannot be negative (got {self.gpu_hours})."
            )
        if self.period == self.Period.DAYS:
            if not self.period_days:
                errors["period_days"] = "'Every N days' needs N (1 or more)."
        elif self.period_days is not None:
            errors["period_days"] = "Only 'every N days' periods take a number of days."
        if errors:
            raise ValidationError(errors)

    @property
    def period_label(self) -> str:
        """'month', 'week' or '30-day period' (for messages: 'this month')."""
        if self.period == self.Period.DAYS:
            return f"{self.period_days}-day period"
        return str(self.period)

    def period_bounds(self, now: datetime) -> tuple[datetime, datetime]:
        """[start, end) of the period ``now`` is in: midnights in ``TIME_ZONE``."""
        zone = ZoneInfo(settings.TIME_ZONE)
        today = now.astimezone(zone).date()
        if self.period == self.Period.MONTH:
            first = today.replace(day=1)
            following = (first + timedelta(days=32)).replace(day=1)
        elif self.period == self.Period.WEEK:
            first = today - timedelta(days=today.weekday())
            following = first + timedelta(days=7)
        else:
            n = self.period_days or 1
            k = (today - self.anchor).days // n
            first = self.anchor + timedelta(days=k * n)
            following = first + timedelta(days=n)
        return (
            datetime.combine(first, time(0), tzinfo=zone),
            datetime.combine(following, time(0), tzinfo=zone),
        )

    def as_dict(self) -> dict[str, Any]:
        """Its editable values, as the audit log keeps them (JSON)."""
        return {
            "group": self.group.name if self.group is not None else None,
            "user": self.user.get_username() if self.user is not None else None,
            "gpu_hours": None
            if self.gpu_hours is None
            else str(Decimal(self.gpu_hours).quantize(Decimal("0.001"))),
            "period": self.period,
            "period_days": self.period_days,
            "anchor": self.anchor.isoformat() if self.anchor else None,
            "max_gpus": self.max_gpus,
            "hard": self.hard,
            "note": self.note,
        }


class QuotaAlert(models.Model):
    """A quota reached ``threshold`` % of its GPU-hours in the period starting at
    ``period_start``. Recorded once per quota, threshold and period (a unique
    constraint: two passes never alert twice); ``alerts.on_alert`` is called for
    each new one."""

    THRESHOLDS: ClassVar = (80, 100)

    quota = models.ForeignKey(Quota, on_delete=models.CASCADE, related_name="alerts")
    threshold = models.PositiveSmallIntegerField()
    period_start = models.DateTimeField()
    used_gpu_hours = models.FloatField()
    limit_gpu_hours = models.FloatField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("-created_at",)
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["quota", "threshold", "period_start"],
                name="%(app_label)s_%(class)s_once_per_period",
            )
        ]

    def __str__(self) -> str:
        return f"{self.quota.target} at {self.threshold}%"


class AuditEntry(models.Model):
    """One change made in the admin console (or by a service verb that records
    it): who, when, what, the values before and after (JSON; null before a
    creation and after a deletion). Never edited."""

    class Action(models.TextChoices):
        CREATE = "create", "created"
        UPDATE = "update", "changed"
        DELETE = "delete", "deleted"

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    # Kept as text too: the entry outlives the account.
    actor_name = models.CharField(max_length=150, blank=True)
    action = models.CharField(max_length=8, choices=Action.choices)
    object_type = models.CharField(max_length=64)  # e.g. "quota"
    object_id = models.BigIntegerField()
    object_repr = models.CharField(max_length=200)
    old = models.JSONField(null=True, blank=True)
    new = models.JSONField(null=True, blank=True)
    via = models.CharField(max_length=32, default="admin")  # admin, service, ...

    class Meta:
        ordering = ("-at", "-id")
        verbose_name_plural = "audit entries"
        indexes: ClassVar = [models.Index(fields=["object_type", "object_id"])]

    def __str__(self) -> str:
        return f"{self.actor_name or 'system'} {self.action} {self.object_repr}"
