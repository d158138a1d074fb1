"""The Usage page and its CSV export."""

from __future__ import annotations

import csv
from datetime import UTC, date, timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone

from portal.accounting import reports
from portal.quotas.models import Quota
from portal.quotas.usage import quota_states
from scheduler.models import Group, Membership

if TYPE_CHECKING:
    from collections.abc import Iterator

    from portal.http import AuthenticatedHttpRequest

DEFAULT_DAYS = 30


class RangeForm(forms.Form):
    """A range of UTC days, both ends included (GET ``from`` / ``to``)."""

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
    writer = csv.writer(_Echo())
    rows: Iterator[list[str]] = reports.csv_rows(scope, first, last, timezone.now())
    who = group.name if group else request.user.get_username()
    response = StreamingHttpResponse(
        (writer.writerow(row) for row in rows), content_type="text/csv"
    )
    response["Content-Disposition"] = (
        f'attachment; filename="gpulab-usage-{who}-{first}-{last}.csv"'
    )
    return response
