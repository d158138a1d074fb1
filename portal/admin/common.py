"""What the console's admins share: the acting admin, the per-object report of
an action, a count subquery for list columns, and the admin of a record that
nobody edits by hand."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from django.contrib import admin, messages
from django.contrib.auth.models import User
from django.db.models import Count, Model, Subquery, Value
from django.db.models.functions import Coalesce

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest

_M = TypeVar("_M", bound=Model)


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


class ReadOnlyAdmin(admin.ModelAdmin[_M]):
    """A record gpulab writes (a job's history, the charging ledger, what the
    agents reported): listed and shown, never added, changed or deleted by hand,
    whoever asks (superusers too): a POST to its change or delete page is
    refused (403) and changes nothing."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: _M | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: _M | None = None
    ) -> bool:
        return False
