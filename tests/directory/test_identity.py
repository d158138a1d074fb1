"""Following the directory: an identity applied to a user's groups, staff flag and
Unix account (only the groups the mapping names), and a removal followed through to
sessions, tokens, waiting and running jobs and the audit log (real PostgreSQL and
Redis)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.core.exceptions import ImproperlyConfigured
from django.test import Client

from portal.api.tokens import create_token
from portal.directory.identity import (
    DirectoryIdentity,
    IdentityRefused,
    apply_identity,
    deactivate_user,
    user_group,
)
from portal.directory.mapping import GroupMapping
from portal.quotas.models import AuditEntry
from scheduler.models import Group, Job, JobEvent, Membership
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from pytest_django.fixtures import SettingsWrapper

    from scheduler.models import Node
    from tests.capture import Channels

MAPPING = GroupMapping.parse(
    "vision-lab=vision,nlp-lab=nlp,NLP-Students=nlp",
    "vision-pis=vision",
    "gpulab-admins",
)


@pytest.fixture(autouse=True)
def _mapping(settings: SettingsWrapper) -> None:
    settings.GPULAB_DIRECTORY_MAPPING = MAPPING
    settings.GPULAB_DIRECTORY_CANCEL_RUNNING = False


def ident(**changes: Any) -> DirectoryIdentity:
    values: dict[str, Any] = {
        "username": "dora",
        "source": "ldap",
        "email": "dora@uni.example",
        "first_name": "Dora",
        "last_name": "Explorer",
        "groups": frozenset({"vision-pis", "nlp-students", "physics"}),
        "unix_name": "dora",
        "uid": 20001,
        "gid": 20001,
        "gids": (20001, 5000, 5001),
    }
    values.update(changes)
    return DirectoryIdentity(**values)


def memberships(user: User) -> dict[str, bool]:
    return {
        m.group.name: m.is_leader
        for m in Membership.objects.filter(user=user).select_related("group")
    }


# ------------------------------------------------------------------ mapping


@pytest.mark.parametrize(
    ("args", "named", "what"),
    [
        (("vision-lab", "", ""), "GPULAB_DIRECTORY_GROUP_MAP", "'vision-lab'"),
        (("a=vision lab", "", ""), "GPULAB_DIRECTORY_GROUP_MAP", "'vision lab'"),
        (("", "=vision", ""), "GPULAB_DIRECTORY_LEADER_GROUPS", "'=vision'"),
        (("", "", "admins=staff"), "GPULAB_DIRECTORY_STAFF_GROUPS", "'admins=staff'"),
    ],
)
def test_a_wrong_mapping_names_the_setting_and_the_entry(
    args: tuple[str, str, str], named: str, what: str
) -> None:
    with pytest.raises(ImproperlyConfigured) as error:
        GroupMapping.parse(*args)
    assert named in str(error.value)
    assert what in str(error.value)


def test_the_mapping_folds_case_and_merges_leaders() -> None:
    assert MAPPING.managed() == {"vision", "nlp"}
    assert MAPPING.memberships(["VISION-LAB", "nlp-students"]) == {
        "vision": False,
        "nlp": False,
    }
    assert MAPPING.memberships(["vision-lab", "vision-pis"]) == {"vision": True}
    assert MAPPING.is_staff(["Gpulab-Admins"]) is True
    assert GroupMapping.parse("a=b", "", "").is_staff(["x"]) is None


# ------------------------------------------------------------------ apply


def test_a_first_identity_gives_groups_leader_and_unix_numbers(db: None) -> None:
    Group.objects.create(name="vision")
    user = User.objects.create_user("dora")
    changes = apply_identity(user, ident())
    user.refresh_from_db()
    profile = user.gpulab
    assert memberships(user) == {"vision": True, "nlp": False}
    assert user.email == "dora@uni.example"
    assert user.is_staff is False
    assert (profile.unix_account, profile.unix_uid, profile.unix_gid) == (
        "dora",
        20001,
        20001,
    )
    # The primary gid is not repeated among the supplementary ones.
    assert profile.unix_gids == [5000, 5001]
    assert profile.directory == "ldap"
    assert profile.primary_group is not None
    assert "joined group vision as leader" in changes
    entry = AuditEntry.objects.get(object_type="user", object_id=user.pk)
    assert entry.via == "ldap"
    assert entry.new["unix_uid"] == 20001
    assert entry.old["groups"] == {}


def test_a_group_change_is_followed_and_hand_made_groups_stay(db: None) -> None:
    user = User.objects.create_user("dora")
    apply_identity(user, ident())
    robotics = Group.objects.create(name="robotics")  # not in the mapping
    Membership.objects.create(user=user, group=robotics)
    changes = apply_identity(
        user, ident(groups=frozenset({"vision-lab", "gpulab-admins"}), uid=20002)
    )
    user.refresh_from_db()
    assert memberships(user) == {"vision": False, "robotics": False}
    assert user.is_staff is True
    assert user.gpulab.unix_uid == 20002
    assert "left group nlp" in changes
    assert "now member of group vision" in changes
    assert AuditEntry.objects.filter(object_type="user", object_id=user.pk).count() == 2
    # Nothing changed: nothing recorded.
    assert (
        apply_identity(
            user, ident(groups=frozenset({"vision-lab", "gpulab-admins"}), uid=20002)
        )
        == []
    )
    assert AuditEntry.objects.filter(object_type="user", object_id=user.pk).count() == 2


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"uid": 0}, "unix_uid"),
        ({"gid": None}, "unix_gid"),
        ({"gids": (0,)}, "unix_gids"),
    ],
)
def test_an_unusable_unix_account_is_refused_and_changes_nothing(
    db: None, changes: dict[str, Any], field: str
) -> None:
    user = User.objects.create_user("dora")
    with pytest.raises(IdentityRefused, match=f"'dora' cannot be used: {field}"):
        apply_identity(user, ident(**changes))
    assert not Membership.objects.filter(user=user).exists()
    assert not AuditEntry.objects.exists()


# ------------------------------------------------------------------ removal


def test_removal_ends_sessions_tokens_and_holds_waiting_jobs(
    db: None,
    cluster: list[Node],
    channels: Channels,
    groups: dict[str, Any],
    django_capture_on_commit_callbacks: Any,
) -> None:
    user = User.objects.create_user("dora", password="pw-dora-123")
    apply_identity(user, ident())
    other = User.objects.create_user("eve", password="pw-eve-123")
    browser, bystander = Client(), Client()
    browser.force_login(user)
    bystander.force_login(other)
    token, _ = create_token(user, "laptop", None)
    waiting = JobFactory(owner=user, group=groups["vision"])
    running = JobFactory(owner=user, group=groups["vision"])
    start_job(running, cluster[0])
    channels.join(user_group(user.pk))

    with django_capture_on_commit_callbacks(execute=True):
        deactivate_user(user, "removed from the directory")

    user.refresh_from_db()
    assert user.is_active is False
    assert user.gpulab.directory_disabled is True
    assert browser.get("/").status_code == 302  # back to the login page
    assert bystander.get("/").status_code == 200
    assert Session.objects.count() == 1
    token.refresh_from_db()
    assert token.revoked_at is not None
    waiting.refresh_from_db()
    assert waiting.status == Job.Status.HELD
    assert waiting.held_by is None  # only an admin releases it
    assert "removed from the directory" in waiting.pending_message
    running.refresh_from_db()
    assert running.status == Job.Status.STARTING  # left to run
    assert running.cancel_requested_at is None
    assert {"type": "user.signed_out"} in channels.messages(user_group(user.pk))
    entry = AuditEntry.objects.filter(object_type="user", object_id=user.pk).first()
    assert entry is not None
    assert entry.new["jobs_held"] == [waiting.pk]
    assert entry.new["jobs_left_running"] == [running.pk]
    assert entry.new["tokens_revoked"] == 1


def test_removal_holds_50_waiting_jobs_in_as_many_queries_as_5(
    db: None, cluster: list[Node], groups: dict[str, Any]
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def cost(name: str, jobs: int) -> int:
        user = User.objects.create_user(name)
        apply_identity(user, ident())
        waiting = [JobFactory(owner=user, group=groups["vision"]) for _ in range(jobs)]
        with CaptureQueriesContext(connection) as queries:
            deactivate_user(user, "removed from the directory")
        assert set(Job.objects.filter(owner=user).values_list("status", "held_by")) == {
            (Job.Status.HELD, None)
        }
        assert JobEvent.objects.filter(job__in=waiting, to_status="held").count() == (
            jobs
        )
        return len(queries)

    assert cost("dora", 50) == cost("eve", 5)


def test_removal_may_cancel_running_jobs(
    db: None, cluster: list[Node], settings: SettingsWrapper, groups: dict[str, Any]
) -> None:
    settings.GPULAB_DIRECTORY_CANCEL_RUNNING = True
    user = User.objects.create_user("dora")
    apply_identity(user, ident())
    running = JobFactory(owner=user, group=groups["vision"])
    start_job(running, cluster[0])
    deactivate_user(user, "disabled in the directory")
    running.refresh_from_db()
    assert running.cancel_requested_at is not None


def test_a_disabled_identity_deactivates_and_a_returning_one_reactivates(
    db: None,
) -> None:
    user = User.objects.create_user("dora")
    apply_identity(user, ident())
    apply_identity(user, ident(active=False))
    user.refresh_from_db()
    assert user.is_active is False
    apply_identity(user, ident())
    user.refresh_from_db()
    assert user.is_active is True
    # A deactivation by hand is not the directory's to undo.
    User.objects.filter(pk=user.pk).update(is_active=False)
    user.refresh_from_db()
    apply_identity(user, ident())
    user.refresh_from_db()
    assert user.is_active is False
