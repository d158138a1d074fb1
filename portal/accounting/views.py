"""The Usage page and its CSV export."""

from __future__ import annotations

import csv
import itertools
from datetime import UTC, date, timedelta
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django import forms
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone

from portal.accounting import reports
from portal.quotas.models import Quota
from portal.quotas.usage import quota_states
from scheduler.models import Group, Membership

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from portal.http import AuthenticatedHttpRequest

DEFAULT_DAYS = 30


class RangeForm(forms.Form):
    """A range of UTC days, both ends included (GET ``from`` / ``to``), at most
    ``GPULAB_USAGE_MAX_DAYS`` long: what a report costs grows with its days, so a
    range of centuries is refused (naming the limit) before anything is read."""

    group = forms.CharField(required=False)

    def __init__(self, data: Any, today: date) -> None:
        super().__init__(data)
        self.fields["from"] = forms.DateField(
            required=False, initial=today - timedelta(DEFAULT_DAYS - 1)
        )
        self.fields["to"] = forms.DateField(required=False, initial=today)
        self.today = today

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        first = data.get("from") or self.today - timedelta(DEFAULT_DAYS - 1)
        last = data.get("to") or self.today
        if "from" in self.errors or "to" in self.errors:
            return data
        if first > last:
            raise forms.ValidationError(
                f"The range starts ({first}) after it ends ({last}).", code="order"
            )
        days = (last - first).days + 1
        limit = settings.GPULAB_USAGE_MAX_DAYS
        if days > limit:
            self.add_error(
                "to",
                forms.ValidationError(
                    f"The range from {first} to {last} spans {days} days; at most"
                    f" {limit} days (GPULAB_USAGE_MAX_DAYS) at a time.",
                    code="span",
                ),
            )
            return data
        data["from"], data["to"] = first, last
        return data


def _scope_for(
    request: AuthenticatedHttpRequest, name: str
) -> tuple[reports.Scope, Group | None]:
    """Whose usage the request may see: its user's own without a group; a group's
    only for staff and the group's leaders (403 otherwise, whether or not the
    group exists: no existence leak)."""
    user = request.user
    if not name:
        return reports.Scope(user_id=user.pk), None
    group = Group.objects.filter(name=name).first()
    allowed = user.is_staff or (
        group is not None
        and Membership.objects.filter(user=user, group=group, is_leader=True).exists()
    )
    if not allowed:
        raise PermissionDenied("You may not see this group's usage.")
    if group is None:
        raise PermissionDenied("No such group.")
    return reports.Scope(group_id=group.pk), group


def _today() -> date:
    return timezone.now().astimezone(UTC).date()


@login_required
def usage(request: AuthenticatedHttpRequest) -> HttpResponse:
    form = RangeForm(request.GET, _today())
    valid = form.is_valid()
    name = form.cleaned_data.get("group", "") if valid else request.GET.get("group", "")
    scope, group = _scope_for(request, name)
    context: dict[str, Any] = {
        "form": form,
        "group": group,
        "groups": reports.groups_visible_to(request.user),
        "report": None,
        # The quotas of what is shown, in their current period: the user's own and
        # their groups' (their jobs are subject to both), or the group's.
        "quotas": quota_states(
            quotas=Quota.objects.filter(group=group).select_related("group", "user")
            if group is not None
            else Quota.objects.for_user(request.user)
        ),
    }
    status = 200
    if valid:
        report = reports.report(
            scope, form.cleaned_data["from"], form.cleaned_data["to"], timezone.now()
        )
        context["report"] = report
        context["chart"] = {
            "days": [d.isoformat() for d in report.days],
            "series": report.series,
        }
        query = request.GET.copy()
        query["from"] = report.first.isoformat()
        query["to"] = report.last.isoformat()
        context["csv_query"] = query.urlencode()
    else:
        status = 400
    return render(request, "accounting/usage.html", context, status=status)


class _Echo:
    def write(self, value: str) -> str:
        return value


# CSV rows read and sent at a time (a batch is a few hundred KB at most).
CSV_BATCH = 1000


def _csv_text(rows: Iterator[list[str]]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    return (writer.writerow(row) for row in rows)


async def _csv_batches(rows: Iterator[list[str]]) -> AsyncIterator[str]:
    """The rows as CSV text, ``CSV_BATCH`` at a time, each batch read in the
    request's own thread (its database connection holds the export's cursor).
    Under ASGI Django reads a synchronous iterator whole into memory before its
    first byte goes out; this keeps an export of any size at one batch."""
    text = _csv_text(rows)

    def batch() -> str:
        return "".join(itertools.islice(text, CSV_BATCH))

    while chunk := await sync_to_async(batch)():
        yield chunk


@login_required
def usage_csv(
    request: AuthenticatedHttpRequest,
) -> HttpResponse | StreamingHttpResponse:
    form = RangeForm(request.GET, _today())
    valid = form.is_valid()
    name = form.cleaned_data.get("group", "") if valid else request.GET.get("group", "")
    scope, group = _scope_for(request, name)
    if not valid:
        problems = "; ".join(
            f"{field}: {' '.join(str(e) for e in errs)}"
            if field != "__all__"
            else " ".join(str(e) for e in errs)
            for field, errs in form.errors.items()
        )
        return HttpResponse(
            f"Bad date range: {problems}\n",
            status=400,
            content_type="text/plain; charset=utf-8",
        )
    first, last = form.cleaned_data["from"], form.cleaned_data["to"]
    rows: Iterator[list[str]] = reports.csv_rows(scope, first, last, timezone.now())
    who = group.name if group else request.user.get_username()
    # Served by the ASGI server (make up, production): batches, constant memory;
    # by a WSGI one, Django streams the synchronous iterator as it is.
    content = (
        _csv_batches(rows) if isinstance(request, ASGIRequest) else _csv_text(rows)
    )
    response = StreamingHttpResponse(content, content_type="text/csv")
    response["Content-Disposition"] = (
        f'attachment; filename="gpulab-usage-{who}-{first}-{last}.csv"'
    )
    return response
