"""The verbs that change quotas: every change is recorded in the audit log in the
same transaction. The admin console calls these; so should any other writer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.quotas.models import AuditEntry, Quota

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User
    from django.db.models import Model


def record(
    actor: User | AnonymousUser | None,
    action: AuditEntry.Action,
    obj: Model,
    *,
    old: dict[str, Any] | None,
    new: dict[str, Any] | None,
    via: str = "admin",
) -> AuditEntry:
    """One audit entry: who (None: the system) changed ``obj`` from ``old`` to
    ``new`` (JSON values; None before a creation, after a deletion)."""
    user = actor if actor is not None and not actor.is_anonymous else None
    return AuditEntry.objects.create(
        actor=user,
        actor_name=user.get_username() if user is not None else "",
        action=action,
        object_type=obj._meta.model_name or "",
        object_id=obj.pk,
        object_repr=str(obj)[:200],
        old=old,
        new=new,
        via=via,
    )


def save_quota(
    quota: Quota,
    *,
    by: User | AnonymousUser | None,
    via: str = "admin",
) -> Quota:
    """Create or change ``quota`` after validating it (``ValidationError`` with
    field-keyed messages; nothing is stored then), and record the change.

    1. Validate (``full_clean``: the model's rules and constraints).
    2. In one transaction: lock the stored row (a concurrent edit waits), take its
       old values, save, record ``old`` -> ``new``; a save that changes nothing
       records nothing.
    3. A concurrent creation of a second quota for the same group or user passes
       step 1 but breaks a unique constraint: the same ``ValidationError`` as step
       1 would have raised, nothing stored.
    """
    quota.full_clean()
    with transaction.atomic():
        old = None
        if quota.pk is not None:
            stored = (
                Quota.objects.select_for_update(of=("self",))
                .select_related("group", "user")
                .filter(pk=quota.pk)
                .first()
            )
            old = stored.as_dict() if stored is not None else None
        new = quota.as_dict()
        if old == new:
            return quota
        quota.updated_at = timezone.now()
        try:
            with transaction.atomic():
                quota.save()
        except IntegrityError as exc:
            if "one_per_" not in str(exc):
                raise
            field = "group" if quota.group_id is not None else "user"
            raise ValidationError(
                {field: f"This {field} already has a quota."}
            ) from None
        record(
            by,
            AuditEntry.Action.CREATE if old is None else AuditEntry.Action.UPDATE,
            quota,
            old=old,
            new=new,
            via=via,
        )
    return quota


def delete_quota(
    quota_id: int,
    *,
    by: User | AnonymousUser | None,
    via: str = "admin",
) -> bool:
    """Delete a quota and record it (its alerts go with it). False if it was
    already gone (a concurrent delete): nothing is recorded twice."""
    with transaction.atomic():
        quota = (
            Quota.objects.select_for_update(of=("self",))
            .select_related("group", "user")
            .filter(pk=quota_id)
            .first()
        )
        if quota is None:
            return False
        old = quota.as_dict()
        record(by, AuditEntry.Action.DELETE, quota, old=old, new=None, via=via)
        quota.delete()
    return True
