"""What a directory (LDAP) or identity provider (OpenID Connect) says about a user,
and how gpulab follows it: ``apply_identity`` at each sign-in and refresh,
``deactivate_user`` when the directory removed or disabled the account.

Only the gpulab groups named in the mapping settings are the directory's to
decide (``GroupMapping.managed``); other memberships, made by hand, are left
alone. Every change is written to the audit log (``portal.quotas`` ``AuditEntry``,
object type ``user``, via ``ldap``/``oidc``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.sessions.models import Session
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError

from portal.api.models import ApiToken
from portal.quotas.models import AuditEntry
from portal.quotas.services import record
from scheduler.lifecycle import Cause
from scheduler.models import Group, Job, JobEvent, Membership, Profile
from scheduler.services.jobs import cancel_job
from scheduler.services.lifecycle import transition_many

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from portal.directory.mapping import GroupMapping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectoryIdentity:
    """What a directory or identity provider says about one user at sign-in or refresh."""

    username: str  # the gpulab (Django) username
    source: str  # "ldap" or "oidc"
    email: str = ""
    first_name: str = ""
    last_name: str = ""
    # The directory's group names (LDAP: the group cn; OIDC: the groups claim).
    groups: frozenset[str] = frozenset()
    unix_name: str = ""  # posix login name; "" = none known
    uid: int | None = None
    gid: int | None = None
    gids: tuple[int, ...] = ()  # supplementary gids
    active: bool = True  # False: disabled in the directory


class IdentityRefused(ValueError):
    """What the directory says of a user is not usable (uid 0, a uid without a gid,
    a malformed account name): the message says what; nothing was changed."""


def user_group(user_id: int) -> str:
    """The Channels group of a user's open browser websockets (closed on removal)."""
    return f"user.{user_id}"


def _mapping() -> GroupMapping:
    mapping: GroupMapping = settings.GPULAB_DIRECTORY_MAPPING
    return mapping


def _audit(user: User, source: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    record(None, AuditEntry.Action.UPDATE, user, old=old, new=new, via=source)


def _account_state(user: User, profile: Profile) -> dict[str, Any]:
    """What the directory decides about ``user``, as the audit log keeps it."""
    managed = _mapping().managed()
    groups = {
        m.group.name: m.is_leader
        for m in Membership.objects.filter(user=user).select_related("group")
        if m.group.name in managed
    }
    return {
        "email": user.email,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "is_active": user.is_active,
        "is_staff": user.is_staff,
        "groups": {
            name: ("leader" if lead else "member") for name, lead in groups.items()
        },
        "unix_account": profile.unix_account,
        "unix_uid": profile.unix_uid,
        "unix_gid": profile.unix_gid,
        "unix_gids": list(profile.unix_gids),
    }


def _describe(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    changes = []
    for key in new:
        if key == "groups":
            for name in sorted(set(old[key]) | set(new[key])):
                before, after = old[key].get(name), new[key].get(name)
                if before == after:
                    continue
                if after is None:
                    changes.append(f"left group {name}")
                elif before is None:
                    changes.append(f"joined group {name} as {after}")
                else:
                    changes.append(f"now {after} of group {name}")
        elif old[key] != new[key]:
            changes.append(f"{key}: {old[key]!r} -> {new[key]!r}")
    return changes


def apply_identity(user: User, identity: DirectoryIdentity) -> list[str]:
    """Make the user's gpulab groups (Membership, is_leader), is_staff and Unix account
    (Profile.unix_account/unix_uid/unix_gid/unix_gids) match the identity, per the
    mapping settings; returns human-readable changes (also written to the audit log).
    If identity.active is False, calls deactivate_user.

    ``IdentityRefused`` (nothing changed) when the Unix account is unusable. The
    profile is marked as kept in step with ``identity.source`` (the periodic
    refresh looks these users up again). A user this directory had deactivated and
    now has again (active) is reactivated; one deactivated by hand stays so.
    """
    with transaction.atomic():
        profile, _ = Profile.objects.select_for_update().get_or_create(user=user)
        old = _account_state(user, profile)
        mapping = _mapping()
        user.email = identity.email or user.email
        user.first_name = identity.first_name[:150] or user.first_name
        user.last_name = identity.last_name[:150] or user.last_name
        staff = mapping.is_staff(identity.groups)
        if staff is not None:
            user.is_staff = staff
        if identity.active and profile.directory_disabled:
            user.is_active = True
            profile.directory_disabled = False
        user.save()

        wanted = mapping.memberships(identity.groups)
        current = {
            m.group.name: m
            for m in Membership.objects.filter(user=user).select_related("group")
        }
        for name in mapping.managed():
            membership = current.get(name)
            if name not in wanted:
                if membership is not None:
                    membership.delete()
                continue
            if membership is None:
                group, _ = Group.objects.get_or_create(name=name)
                Membership.objects.create(
                    user=user, group=group, is_leader=wanted[name]
                )
            elif membership.is_leader != wanted[name]:
                membership.is_leader = wanted[name]
                membership.save(update_fields=["is_leader"])

        if identity.unix_name:
            profile.unix_account = identity.unix_name
        if identity.uid is not None:
            profile.unix_uid = identity.uid
            profile.unix_gid = identity.gid
            profile.unix_gids = sorted(set(identity.gids) - {identity.gid})
        member_of = set(
            Membership.objects.filter(user=user).values_list("group_id", flat=True)
        )
        if profile.primary_group_id not in member_of:
            first = Group.objects.filter(pk__in=member_of, name__in=wanted).first()
            profile.primary_group = first
        profile.directory = identity.source
        profile.directory_checked_at = timezone.now()
        try:
            profile.full_clean(exclude=["user"])
        except ValidationError as exc:
            # Rolled back with the rest: a directory entry gpulab cannot use
            # (uid 0, a uid without a gid, ...) changes nothing.
            problems = "; ".join(
                f"{field}: {' '.join(messages)}"
                for field, messages in exc.message_dict.items()
            )
            raise IdentityRefused(
                f"{identity.source} account {identity.username!r} cannot be used:"
                f" {problems}"
            ) from None
        profile.save()

        new = _account_state(user, profile)
        changes = _describe(old, new)
        if changes:
            _audit(user, identity.source, old, new)
            log.info(
                "%s: %s follows the directory: %s",
                identity.source,
                user.get_username(),
                "; ".join(changes),
            )
    if not identity.active:
        reason = f"disabled in the directory ({identity.source})"
        if user.is_active:
            deactivate_user(user, reason)
            changes.append(reason)
    return changes


def _close_websockets(user_id: int) -> None:
    layer = get_channel_layer()
    if layer is None:  # pragma: no cover - CHANNEL_LAYERS is always configured
        return
    try:
        async_to_sync(layer.group_send)(
            user_group(user_id), {"type": "user.signed_out"}
        )
    except (RedisError, OSError) as exc:
        # The sessions are gone: a socket still open can subscribe to nothing new
        # once its page reloads.
        log.error("could not close the websockets of user %s: %r", user_id, exc)


def _delete_sessions(user: User) -> int:
    """Delete every login session of ``user`` (database sessions: each is decoded)."""
    doomed = [
        session.pk
        for session in Session.objects.filter(expire_date__gt=timezone.now()).iterator()
        if str(session.get_decoded().get("_auth_user_id")) == str(user.pk)
    ]
    Session.objects.filter(pk__in=doomed).delete()
    return len(doomed)


def deactivate_user(user: User, reason: str) -> None:
    """Directory removal: login sessions deleted, open websockets closed, API/CLI tokens
    revoked, waiting jobs held with the reason, running jobs left to finish unless
    GPULAB_DIRECTORY_CANCEL_RUNNING; user.is_active False; all in the audit log."""
    now = timezone.now()
    with transaction.atomic():
        profile, _ = Profile.objects.select_for_update().get_or_create(user=user)
        source = profile.directory or "directory"
        was_active = user.is_active
        user.is_active = False
        user.save(update_fields=["is_active"])
        profile.directory_disabled = True
        profile.save(update_fields=["directory_disabled"])
        sessions = _delete_sessions(user)
        tokens = ApiToken.objects.filter(user=user, revoked_at__isnull=True).update(
            revoked_at=now
        )
        waiting = list(
            Job.objects.select_for_update()
            .filter(
                owner=user, status=Job.Status.PENDING, cancel_requested_at__isnull=True
            )
            .order_by("pk")
        )
        # one UPDATE and one insert of events however many jobs wait
        transition_many(
            waiting,
            Job.Status.HELD,
            Cause.HOLD,
            f"held: its owner was {reason}",
            source=JobEvent.Source.SYSTEM,
            summary=f"{len(waiting)} waiting jobs held: their owner was {reason}",
            notice="held",
            held_by=None,
            pending_reason="held",
            pending_message=f"held: its owner was {reason}; an admin may release it",
            queue_order=None,
            est_start=None,
        )
        held = [job.pk for job in waiting]
        running = list(
            Job.objects.filter(
                owner=user,
                status__in=(Job.Status.STARTING, Job.Status.RUNNING),
                cancel_requested_at__isnull=True,
            ).values_list("pk", flat=True)
        )
        cancelled = []
        if settings.GPULAB_DIRECTORY_CANCEL_RUNNING:
            for job_id in running:
                cancel_job(job_id, by=None, reason=f"its owner was {reason}")
                cancelled.append(job_id)
        record(
            None,
            AuditEntry.Action.UPDATE,
            user,
            old={"is_active": was_active},
            new={
                "is_active": False,
                "reason": reason,
                "sessions_deleted": sessions,
                "tokens_revoked": tokens,
                "jobs_held": held,
                "jobs_cancelled": cancelled,
                "jobs_left_running": [j for j in running if j not in cancelled],
            },
            via=source,
        )
        transaction.on_commit(lambda: _close_websockets(user.pk))
    log.warning(
        "%s: %s deactivated (%s): %d sessions deleted, %d tokens revoked,"
        " jobs held %s, cancelled %s",
        source,
        user.get_username(),
        reason,
        sessions,
        tokens,
        held,
        cancelled,
    )
