"""What the console's actions share: the acting admin, the per-object report of
an action, and a count subquery for list columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.auth.models import User
from django.db.models import Count, Subquery, Value
from django.db.models.functions import Coalesce

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest


def acting_user(request: HttpRequest) -> User:
    """The admin behind a console action (the admin site admits only staff)."""
    assert isinstance(request.user, User)
    return request.user


def report_action(
    modeladmin: admin.ModelAdmin[Any],
    request: HttpRequest,
    verb: str,
    done: int,
    skipped: list[str],
) -> None:
    """One message per action with the result for every object, e.g.
    "3 held, 1 skipped: Job #5 is running; only a pending job can be held."."""
    text = f"{done} {verb}"
    if skipped:
        text += f", {len(skipped)} skipped: " + " ".join(skipped)
    level = messages.SUCCESS
    if skipped:
        level = messages.WARNING if done else messages.ERROR
    modeladmin.message_user(request, text, level)


def count_subquery(queryset: QuerySet[Any], key: str, field: str) -> Coalesce:
    """COUNT(DISTINCT field) of a queryset filtered on OuterRef, as a subquery."""
    rows = queryset.order_by().values(key).annotate(n=Count(field, distinct=True))
    return Coalesce(Subquery(rows.values("n")[:1]), Value(0))
