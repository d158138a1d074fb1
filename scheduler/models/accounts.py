"""Lab groups, their members, and each user's portal settings."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
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


# Unix ids a job may run under: 1 .. 2^32 - 2 (0 is root, which agents refuse;
# 2^32 - 1 is (uid_t) -1, "no change" to setuid).
_UNIX_ID = [MinValueValidator(1), MaxValueValidator(2**32 - 2)]


class Profile(models.Model):
    """Per-user settings of the portal: the Unix account jobs run as on the nodes,
    and where the account comes from (a directory keeps it in step)."""

    class Directory(models.TextChoices):
        NONE = "", "local account"
        LDAP = "ldap", "LDAP"
        OIDC = "oidc", "OpenID Connect"

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
    # The account's numbers (from the directory, or set by an admin): a job's
    # launch carries them and an agent running as root switches to them, so the
    # node need not know the account. None: the node resolves the name.
    unix_uid = models.BigIntegerField(
        null=True,
        blank=True,
        validators=_UNIX_ID,
        help_text="The account's uid on the nodes; empty: the node looks the name up.",
    )
    unix_gid = models.BigIntegerField(
        null=True,
        blank=True,
        validators=_UNIX_ID,
        help_text="The account's primary gid (needed with a uid).",
    )
    unix_gids = ArrayField(
        models.BigIntegerField(validators=_UNIX_ID),
        default=list,
        blank=True,
        help_text="Supplementary gids.",
    )
    # The directory the account is kept in step with (signed in through it):
    # its groups, staff flag and Unix account are refreshed at each sign-in and
    # by the periodic refresh (portal.directory).
    directory = models.CharField(
        max_length=8, choices=Directory.choices, blank=True, default=""
    )
    directory_checked_at = models.DateTimeField(null=True, blank=True)
    # Deactivated because the directory removed or disabled the account: the
    # refresh reactivates it when the directory has it again (a hand-made
    # deactivation stays).
    directory_disabled = models.BooleanField(default=False)
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

    def clean(self) -> None:
        if (self.unix_uid is None) != (self.unix_gid is None):
            raise ValidationError(
                {"unix_gid": "Give the uid and the primary gid together, or neither."}
            )
        if self.unix_gids and self.unix_uid is None:
            raise ValidationError(
                {"unix_gids": "Supplementary gids need a uid and a gid."}
            )
