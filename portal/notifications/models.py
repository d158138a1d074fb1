"""A user's notification preferences and the outbox of deliveries."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django.utils import timezone

from portal.notifications import secrets, targets


class Kind(models.TextChoices):
    """What a notification is about (the events a user may choose)."""

    JOB_STARTED = "job_started", "job started"
    JOB_ENDED = "job_ended", "job ended (completed, cancelled, timed out)"
    JOB_FAILED = "job_failed", "job failed"
    JOB_PREEMPTED = "job_preempted", "job preempted (back in the queue)"
    IDLE_WARNING = "idle_warning", "job idle (its GPUs do nothing)"
    QUOTA_WARNING = "quota_warning", "quota warning (80 % and 100 %)"
    TEST = "test", "test"


# What a user gets before they edit their preferences: everything but starts.
DEFAULT_KINDS: tuple[str, ...] = (
    Kind.JOB_ENDED,
    Kind.JOB_FAILED,
    Kind.JOB_PREEMPTED,
    Kind.IDLE_WARNING,
    Kind.QUOTA_WARNING,
)
# The kinds a user may turn on or off (a test is always sent when asked).
CHOOSABLE: tuple[str, ...] = tuple(k for k in Kind.values if k != Kind.TEST)


def default_kinds() -> list[str]:
    return [str(k) for k in DEFAULT_KINDS]


class Preference(models.Model):
    """Which events a user hears about, and how. No row = the defaults."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="notification_preference",
    )
    kinds = models.JSONField(default=default_kinds)
    email_enabled = models.BooleanField(default=True)
    webhook_url = models.URLField(max_length=500, blank=True)
    # Shared with the receiver, who checks X-Gpulab-Signature with it (README);
    # stored encrypted ("fernet:..."): set and read it through the methods below.
    webhook_secret = models.TextField(blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"notification preferences of {self.user}"

    def clean(self) -> None:
        """A webhook may not lead into the portal's own network (any form that
        saves one, the user's or the admin's, gets the error on the URL)."""
        super().clean()
        if self.webhook_url:
            try:
                targets.check(self.webhook_url)
            except targets.RefusedTarget as exc:
                raise ValidationError({"webhook_url": str(exc)}) from None

    def set_webhook_secret(self, plain: str) -> None:
        """Store ``plain`` encrypted ("": no secret)."""
        self.webhook_secret = secrets.encrypt(plain)

    def read_webhook_secret(self) -> str:
        """The secret ("" if none); raises ``secrets.Unreadable`` when no
        configured key decrypts it (GPULAB_WEBHOOK_SECRET_KEY changed)."""
        return secrets.decrypt(self.webhook_secret)

    @property
    def secret_state(self) -> str:
        """ "none", "set" or "unreadable" (to be set again by its owner)."""
        if not self.webhook_secret:
            return "none"
        try:
            self.read_webhook_secret()
        except secrets.Unreadable:
            return "unreadable"
        return "set"

    def wants(self, kind: str) -> bool:
        return kind == Kind.TEST or kind in self.kinds


class Delivery(models.Model):
    """One notification to one channel: the outbox row a Celery task sends.

    PENDING (due at ``next_attempt_at``) -> SENDING (claimed by a task until
    ``claimed_until``) -> SENT, or back to PENDING with a later ``next_attempt_at``
    after a failure, or FAILED once ``GPULAB_NOTIFY_MAX_ATTEMPTS`` have failed.
    """

    class Channel(models.TextChoices):
        EMAIL = "email", "email"
        WEBHOOK = "webhook", "webhook"

    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        SENDING = "sending", "sending"
        SENT = "sent", "sent"
        FAILED = "failed", "failed"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="notification_deliveries",
    )
    kind = models.CharField(max_length=32, choices=Kind.choices)
    channel = models.CharField(max_length=16, choices=Channel.choices)
    # The e-mail address or webhook URL, as it was when the notification was made.
    target = models.CharField(max_length=500)
    subject = models.CharField(max_length=200)
    text = models.TextField()
    payload = models.JSONField(default=dict, blank=True)
    status = models.CharField(
        max_length=16, choices=Status.choices, default=Status.PENDING
    )
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    claimed_until = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name_plural = "deliveries"
        indexes: ClassVar = [
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(status__in=["pending", "sending"]),
                name="notifications_delivery_due",
            ),
            models.Index(fields=["user", "-created_at"], name="notif_delivery_user"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} to {self.user} by {self.channel} ({self.status})"

    def body(self) -> dict[str, Any]:
        """The webhook's JSON document."""
        return {
            "id": self.pk,
            "kind": self.kind,
            "subject": self.subject,
            "text": self.text,
            "payload": self.payload,
            "user": self.user.get_username(),
            "created_at": self.created_at.isoformat(),
        }
