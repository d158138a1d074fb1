"""Quotas in the admin console: the list shows used / limit / period end, bad input
gets field errors and stores nothing, and every create, edit and delete is in the
audit log (read-only), as are changes made through the service verbs."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

from portal.quotas import services
from portal.quotas.models import AuditEntry, Quota
from tests.portal.quotas.helpers import quota

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(admin_user: Any) -> Client:
    admin_user.is_superuser = True
    admin_user.save()
    client = Client()
    client.force_login(admin_user)
    return client


FORM = {
    "group": "",
    "user": "",
    "gpu_hours": "",
    "period": "month",
    "period_days": "",
    "anchor": "2026-11-01",
    "max_gpus": "",
    "hard": "on",
    "note": "",
}


def test_create_edit_delete_are_in_the_audit_log(
    staff: Client, admin_user: Any, groups: Any
) -> None:
    vision = groups["vision"]
    r = staff.post(
        "/admin/quotas/quota/add/",
        {**FORM, "group": vision.pk, "gpu_hours": "500", "max_gpus": "8"},
    )
    assert r.status_code == 302, r.content.decode()[:2000]
    q = Quota.objects.get()
    [created] = AuditEntry.objects.all()
    assert (created.action, created.actor, created.actor_name) == (
        "create",
        admin_user,
        "root",
    )
    assert (created.object_type, created.object_id, created.via) == (
        "quota",
        q.pk,
        "admin",
    )
    assert created.old is None
    assert created.new["group"] == "vision"
    assert created.new["gpu_hours"] == "500.000"
    assert created.new["max_gpus"] == 8

    r = staff.post(
        f"/admin/quotas/quota/{q.pk}/change/",
        {**FORM, "group": vision.pk, "gpu_hours": "750", "max_gpus": "8", "hard": ""},
    )
    assert r.status_code == 302
    edited = AuditEntry.objects.latest("id")
    assert edited.action == "update"
    assert (edited.old["gpu_hours"], edited.new["gpu_hours"]) == ("500.000", "750.000")
    assert (edited.old["hard"], edited.new["hard"]) == (True, False)
    # shown read-only, with what changed
    page = staff.get(f"/admin/quotas/auditentry/{edited.pk}/change/").content.decode()
    assert "&quot;500.000&quot;" in page
    assert "&quot;750.000&quot;" in page
    assert 'name="_save"' not in page

    r = staff.post(f"/admin/quotas/quota/{q.pk}/delete/", {"post": "yes"})
    assert r.status_code == 302
    assert not Quota.objects.exists()
    deleted = AuditEntry.objects.latest("id")
    assert (deleted.action, deleted.new, deleted.old["gpu_hours"]) == (
        "delete",
        None,
        "750.000",
    )
    assert AuditEntry.objects.count() == 3


def test_bulk_delete_records_each_quota(staff: Client, groups: Any) -> None:
    a = quota(group=groups["vision"], gpu_hours=1)
    b = quota(group=groups["nlp"], gpu_hours=2)
    r = staff.post(
        "/admin/quotas/quota/",
        {"action": "delete_selected", "_selected_action": [a.pk, b.pk], "post": "yes"},
    )
    assert r.status_code == 302
    assert not Quota.objects.exists()
    assert sorted(
        AuditEntry.objects.filter(action="delete").values_list("object_id", flat=True)
    ) == sorted([a.pk, b.pk])


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"gpu_hours": "-5"}, "gpu_hours", "greater than or equal to 0"),
        ({"gpu_hours": "", "max_gpus": ""}, "gpu_hours", "Set GPU-hours, a GPU cap"),
        ({"group": None}, "group", "Choose a group or a user"),
        ({"user": "alice"}, "user", "for a group or for a user, not both"),
        ({"period": "days"}, "period_days", "needs N (1 or more)"),
        ({"period": "days", "period_days": "0"}, "period_days", "needs N"),
        ({"period_days": "7"}, "period_days", "Only 'every N days'"),
        ({"max_gpus": "-1"}, "max_gpus", "greater than or equal to 0"),
    ],
)
def test_bad_input_gets_a_clear_error_and_stores_nothing(
    staff: Client,
    groups: Any,
    alice: Any,
    change: dict[str, Any],
    field: str,
    text: str,
) -> None:
    data = {**FORM, "group": groups["vision"].pk, "gpu_hours": "10", **change}
    if data["group"] is None:
        data["group"] = ""
    if data.get("user") == "alice":
        data["user"] = alice.pk
    r = staff.post("/admin/quotas/quota/add/", data)
    assert r.status_code == 200
    errors = r.context["adminform"].form.errors
    assert text in " ".join(errors.get(field, [])), errors
    assert not Quota.objects.exists()
    assert not AuditEntry.objects.exists()


def test_a_second_quota_for_a_group_is_refused(staff: Client, groups: Any) -> None:
    quota(group=groups["vision"], gpu_hours=1)
    r = staff.post(
        "/admin/quotas/quota/add/",
        {**FORM, "group": groups["vision"].pk, "gpu_hours": "10"},
    )
    assert r.status_code == 200
    assert "This group already has a quota." in r.content.decode()
    assert Quota.objects.count() == 1


def test_the_list_shows_used_limit_and_period_end(
    staff: Client, groups: Any, django_assert_max_num_queries: Any
) -> None:
    quota(group=groups["vision"], gpu_hours=500, max_gpus=8)
    quota(group=groups["nlp"], gpu_hours=20, hard=False)
    page = staff.get("/admin/quotas/quota/").content.decode()
    end = Quota.objects.get(group=groups["vision"]).period_bounds(timezone.now())[1]
    assert "group vision" in page
    assert "500.0" in page
    assert "0 / 8" in page
    assert f"{end:%Y-%m-%d %H:%M}" in page
    assert "soft" in page


def test_the_audit_log_cannot_be_edited_or_deleted(staff: Client, groups: Any) -> None:
    services.save_quota(Quota(group=groups["vision"], gpu_hours=1), by=None)
    entry = AuditEntry.objects.get()
    assert staff.get("/admin/quotas/auditentry/add/").status_code == 403
    r = staff.post(f"/admin/quotas/auditentry/{entry.pk}/delete/", {"post": "yes"})
    assert r.status_code == 403
    assert AuditEntry.objects.count() == 1


def test_non_staff_cannot_see_quotas_or_the_log(alice: Any) -> None:
    client = Client()
    client.force_login(alice)
    for url in ("/admin/quotas/quota/", "/admin/quotas/auditentry/"):
        r = client.get(url)
        assert r.status_code == 403  # signed in but not staff (issue 6)


def test_changes_outside_the_admin_are_logged_too(alice: Any, groups: Any) -> None:
    q = services.save_quota(Quota(user=alice, gpu_hours=5), by=None, via="service")
    q.gpu_hours = 6  # type: ignore[assignment]
    services.save_quota(q, by=None, via="service")
    services.save_quota(q, by=None, via="service")  # no change: no entry
    assert services.delete_quota(q.pk, by=None, via="service")
    assert not services.delete_quota(q.pk, by=None, via="service")  # already gone
    got = list(
        AuditEntry.objects.order_by("id").values_list("action", "via", "actor_name")
    )
    assert got == [
        ("create", "service", ""),
        ("update", "service", ""),
        ("delete", "service", ""),
    ]


def test_the_service_refuses_bad_values_and_stores_nothing(groups: Any) -> None:
    with pytest.raises(ValidationError) as err:
        services.save_quota(Quota(group=groups["vision"], gpu_hours=-1), by=None)
    assert "GPU-hours cannot be negative" in str(err.value.message_dict["gpu_hours"])
    assert not Quota.objects.exists()
    assert not AuditEntry.objects.exists()


def test_a_concurrent_second_quota_for_a_group_is_a_validation_error(
    groups: Any,
) -> None:
    """Two admins adding a quota for one group at once both pass validation; the
    unique constraint refuses the second, with the same clear error."""
    from unittest import mock

    services.save_quota(Quota(group=groups["vision"], gpu_hours=1), by=None)
    with (
        mock.patch.object(Quota, "full_clean", autospec=True),
        pytest.raises(ValidationError) as err,
    ):
        services.save_quota(Quota(group=groups["vision"], gpu_hours=2), by=None)
    assert err.value.message_dict == {"group": ["This group already has a quota."]}
    assert Quota.objects.count() == 1
    assert AuditEntry.objects.count() == 1
