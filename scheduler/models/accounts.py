"""Lab groups, their members, and each user's portal settings."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone


class Group(models.Model):
    """A lab group: users belong to one or more; every job is charged to one."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)
    # Fair-share weight of the group (the fair-share factor reads it).
    shares = models.PositiveIntegerField(default=1)
    members: models.ManyToManyField[Any, Any] = models.ManyToManyField(
        settings.AUTH_USER_MODEL, through="Membership", related_name="lab_groups"
    )

    class Meta:
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """A user's membership of a lab group."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    group = models.ForeignKey(Group, on_delete=models.CASCADE)
    shares = models.PositiveIntegerField(default=1)
    joined_at = models.DateTimeField(default=timezone.now)
    # A group's leaders see its usage and its members' jobs.
    is_leader = models.BooleanField(
        default=False, help_text="Sees the group's usage and its members' jobs."
    )

    class Meta:
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["user", "group"], name="%(app_label)s_%(class)s_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.group}"


class Profile(models.Model):
    """Per-user settings of the portal: the Unix account jobs run as on the nodes."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gpulab"
    )
    unix_account = models.CharField(
        max_length=32,
        blank=True,
        help_text="The user's account on the GPU nodes; jobs run as this account. "
        "Empty: the node's default account, if it allows one.",
        validators=[
            RegexValidator(
                r"^[a-z_][a-z0-9_-]{0,30}\$?$",
                "A Unix account name: lower-case letters, digits, _ and -.",
            )
        ],
    )
    # The group a job is charged to unless its owner picks another at submit.
    primary_group = models.ForeignKey(
        Group,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Charged for the user's jobs unless another group is chosen.",
    )

    def __str__(self) -> str:
        return f"{self.user} ({self.unix_account or 'no Unix account'})"
