"""LDAP sign-in and keeping in step against a real OpenLDAP server (slapd): the
first sign-in creates the account in the right groups with the directory's Unix
numbers; the periodic refresh follows group changes and removals through to
sessions, tokens and jobs; an outage is named on the login page, never a 500, and
changes nothing; a wrong setting stops the process at start naming it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

import portal.settings_directory
from portal.api.tokens import create_token
from portal.directory.tasks import refresh_ldap_users
from portal.quotas.models import AuditEntry
from scheduler.models import Group, Job, Membership
from scheduler.services import launch_frame
from tests.conftest import make_node
from tests.directory.slapd import GROUPS, PEOPLE, person
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from pytest_django.fixtures import SettingsWrapper

    from tests.directory.slapd import Slapd

ROOT = Path(__file__).resolve().parents[2]
MAPPING = {
    "GPULAB_DIRECTORY_GROUP_MAP": "vision-lab=vision,nlp-lab=nlp",
    "GPULAB_DIRECTORY_LEADER_GROUPS": "vision-pis=vision",
    "GPULAB_DIRECTORY_STAFF_GROUPS": "gpulab-admins",
}


def use_directory(
    settings: SettingsWrapper, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    """The settings portal.settings_directory makes of ``env`` (read as at start)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    module = importlib.reload(portal.settings_directory)
    for name in dir(module):
        if name.isupper():
            setattr(settings, name, getattr(module, name))


@pytest.fixture
def directory(
    slapd: Slapd, settings: SettingsWrapper, monkeypatch: pytest.MonkeyPatch, db: None
) -> Slapd:
    """A portal signing in from ``slapd``; the vision group exists (nlp is made
    on first use)."""
    use_directory(settings, monkeypatch, {**slapd.settings(), **MAPPING})
    Group.objects.get_or_create(name="vision")
    return slapd


def sign_in(username: str, password: str) -> tuple[Client, Any]:
    client = Client()
    response = client.post(
        "/accounts/login/", {"username": username, "password": password}
    )
    return client, response


def memberships(user: User) -> dict[str, bool]:
    return {
        m.group.name: m.is_leader
        for m in Membership.objects.filter(user=user).select_related("group")
    }


def test_the_first_sign_in_creates_the_account_from_the_directory(
    directory: Slapd,
) -> None:
    assert not User.objects.filter(username="dora").exists()
    client, response = sign_in("Dora", "dora-pw-1")
    assert response.status_code == 302, response.content.decode()
    assert client.get("/").status_code == 200
    dora = User.objects.get(username="dora")
    assert not dora.has_usable_password()  # the directory checks it
    assert memberships(dora) == {"vision": True}
    assert dora.is_staff is False
    profile = dora.gpulab
    assert profile.directory == "ldap"
    assert (profile.unix_account, profile.unix_uid, profile.unix_gid) == (
        "dora",
        20001,
        20001,
    )
    # vision-lab's gid; her own group's gid is her primary one.
    assert profile.unix_gids == [5000]
    assert profile.primary_group is not None
    assert profile.primary_group.name == "vision"
    assert (dora.email, dora.first_name) == ("dora@uni.example", "Dora")
    # A staff member by the directory, and a group made on first use.
    sign_in("fay", "fay-pw-1")
    fay = User.objects.get(username="fay")
    assert fay.is_staff is True
    assert memberships(fay) == {"vision": False}
    sign_in("ezra", "ezra-pw-1")
    assert memberships(User.objects.get(username="ezra")) == {"nlp": False}
    assert AuditEntry.objects.filter(object_type="user", via="ldap").count() == 3


def test_a_wrong_password_or_an_unknown_user_is_refused(directory: Slapd) -> None:
    for username, password in (("dora", "wrong"), ("nobody", "dora-pw-1")):
        _, response = sign_in(username, password)
        assert response.status_code == 200
        assert "Please enter a correct" in response.content.decode()
    assert not User.objects.filter(username__in=["dora", "nobody"]).exists()


def test_the_refresh_follows_group_changes_and_removals(
    groups: dict[str, Any], directory: Slapd, django_capture_on_commit_callbacks: Any
) -> None:
    client, _ = sign_in("dora", "dora-pw-1")
    sign_in("ezra", "ezra-pw-1")
    dora = User.objects.get(username="dora")
    token, _ = create_token(dora, "laptop", None)
    waiting = JobFactory(owner=dora, group=groups["vision"])

    # Moved from vision to nlp, no longer a PI, and a new uid.
    directory.modify(
        f"dn: cn=vision-lab,{GROUPS}\nchangetype: modify\ndelete: memberUid\n"
        f"memberUid: dora\n\n"
        f"dn: cn=nlp-lab,{GROUPS}\nchangetype: modify\nadd: memberUid\n"
        f"memberUid: dora\n\n"
        f"dn: cn=vision-pis,{GROUPS}\nchangetype: modify\ndelete: member\n"
        f"member: uid=dora,{PEOPLE}\n-\nadd: member\nmember: uid=fay,{PEOPLE}\n\n"
        f"dn: uid=dora,{PEOPLE}\nchangetype: modify\nreplace: uidNumber\n"
        "uidNumber: 20011\n"
    )
    counts = refresh_ldap_users()
    assert counts == {"checked": 2, "changed": 1, "deactivated": 0}
    dora.refresh_from_db()
    assert memberships(dora) == {"nlp": False}
    assert dora.gpulab.unix_uid == 20011
    assert dora.gpulab.unix_gids == [5001]
    assert dora.gpulab.primary_group == groups["nlp"]
    # Her next job's launch carries the new numbers.
    node, _ = make_node("gpu-a", 1)
    attempt = start_job(JobFactory(owner=dora, group=groups["nlp"]), node)
    frame = launch_frame(attempt.job, attempt, list(node.gpus.all()))
    assert frame["data"]["run_as"] == "dora"
    assert frame["data"]["run_as_uid"] == 20011
    assert frame["data"]["run_as_gids"] == [5001]

    # Removed from the directory.
    directory.delete(f"uid=dora,{PEOPLE}")
    with django_capture_on_commit_callbacks(execute=True):
        counts = refresh_ldap_users()
    assert counts == {"checked": 2, "changed": 0, "deactivated": 1}
    dora.refresh_from_db()
    assert dora.is_active is False
    assert client.get("/").status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
    waiting.refresh_from_db()
    assert waiting.status == Job.Status.HELD
    assert "no longer found in the directory" in waiting.pending_message
    entry = AuditEntry.objects.filter(object_type="user", object_id=dora.pk).first()
    assert entry is not None
    assert entry.new["jobs_held"] == [waiting.pk]
    assert User.objects.get(username="ezra").is_active is True
    # Once is enough: the next refresh leaves her as she is.
    assert refresh_ldap_users()["deactivated"] == 0
    assert AuditEntry.objects.filter(object_type="user", object_id=dora.pk).count() == 3
    _, response = sign_in("dora", "dora-pw-1")
    assert response.status_code == 200


def test_a_directory_outage_is_named_and_changes_nothing(
    directory: Slapd, settings: SettingsWrapper
) -> None:
    sign_in("dora", "dora-pw-1")
    admin = User.objects.create_user(
        "root-admin", password="break-glass-9", is_staff=True
    )
    directory.stop()

    _, response = sign_in("dora", "dora-pw-1")
    page = response.content.decode()
    assert response.status_code == 200
    assert f"the lab&#x27;s directory at {directory.uri} could not be reached" in page
    # The break-glass admin still signs in, with a password stored in gpulab.
    client, response = sign_in("root-admin", "break-glass-9")
    assert response.status_code == 302
    assert client.get("/").status_code == 200
    assert client.session["_auth_user_id"] == str(admin.pk)

    # The refresh changes nothing while the directory is away.
    assert refresh_ldap_users() == {"checked": 0, "changed": 0, "deactivated": 0}
    assert User.objects.get(username="dora").is_active is True


def test_local_sign_in_can_be_kept_for_staff_only(
    directory: Slapd, settings: SettingsWrapper
) -> None:
    User.objects.create_user("demo", password="demo-pw-12")
    User.objects.create_user("root-admin", password="break-glass-9", is_staff=True)
    settings.GPULAB_LOCAL_LOGIN = "staff"
    assert sign_in("demo", "demo-pw-12")[1].status_code == 200
    assert sign_in("root-admin", "break-glass-9")[1].status_code == 302
    assert sign_in("dora", "dora-pw-1")[1].status_code == 302
    settings.GPULAB_LOCAL_LOGIN = "off"
    assert sign_in("root-admin", "break-glass-9")[1].status_code == 200
    assert sign_in("dora", "dora-pw-1")[1].status_code == 302


def test_the_login_page_shows_only_what_is_configured(
    settings: SettingsWrapper, db: None
) -> None:
    settings.GPULAB_LDAP_URI = ""
    settings.GPULAB_LOCAL_LOGIN = "off"
    page = Client().get("/accounts/login/").content.decode()
    assert 'name="password"' not in page
    settings.GPULAB_LOCAL_LOGIN = "all"
    page = Client().get("/accounts/login/").content.decode()
    assert 'name="password"' in page
    assert "lab directory" not in page
    settings.GPULAB_LDAP_URI = "ldap://ldap.uni.example"
    page = Client().get("/accounts/login/").content.decode()
    assert "lab directory" in page


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"GPULAB_DIRECTORY_GROUP_MAP": "vision-lab"}, "GPULAB_DIRECTORY_GROUP_MAP"),
        (
            {"GPULAB_DIRECTORY_LEADER_GROUPS": "pis=Vision Lab"},
            "GPULAB_DIRECTORY_LEADER_GROUPS",
        ),
        ({"GPULAB_LOCAL_LOGIN": "some"}, "GPULAB_LOCAL_LOGIN"),
        ({"GPULAB_LDAP_URI": "ldap.uni.example"}, "GPULAB_LDAP_URI"),
        (
            {"GPULAB_LDAP_URI": "ldap://ldap.uni.example"},
            "GPULAB_LDAP_USER_SEARCH_BASE",
        ),
        (
            {
                "GPULAB_LDAP_URI": "ldap://ldap.uni.example",
                "GPULAB_LDAP_USER_SEARCH_BASE": "ou=people,dc=uni",
                "GPULAB_LDAP_USER_FILTER": "(uid=dora)",
            },
            "GPULAB_LDAP_USER_FILTER",
        ),
    ],
)
def test_a_wrong_setting_stops_the_process_at_start(
    env: dict[str, str], named: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert named in result.stderr.splitlines()[-1]


def test_a_directory_account_with_uid_0_cannot_sign_in(directory: Slapd) -> None:
    directory.add(person("toor", 0, 0, "toor-pw-1", "Toor"))
    _, response = sign_in("toor", "toor-pw-1")
    page = response.content.decode()
    assert response.status_code == 200
    assert "your directory account cannot be used here" in page
    assert "unix_uid" in page
    # Created by the sign-in, but with nothing of the refused entry.
    toor = User.objects.get(username="toor")
    assert not Membership.objects.filter(user=toor).exists()
    assert not AuditEntry.objects.filter(object_id=toor.pk).exists()


def test_the_refresh_is_scheduled_when_ldap_is_on() -> None:
    """Celery beat gets the refresh, and the worker knows its task."""
    script = (
        "import django; django.setup()\n"
        "from django.conf import settings\n"
        "from portal.celery import app\n"
        "app.loader.import_default_modules()\n"
        "entry = settings.CELERY_BEAT_SCHEDULE.get('directory-refresh')\n"
        "print(entry and entry['task'], entry and entry['schedule'])\n"
        "print('portal.directory.tasks.refresh' in app.tasks)\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "GPULAB_LDAP_URI": "ldap://ldap.uni.example",
        "GPULAB_LDAP_USER_SEARCH_BASE": "ou=people,dc=uni,dc=example",
        "GPULAB_LDAP_REFRESH_INTERVAL": "600",
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["portal.directory.tasks.refresh", "600.0", "True"]
    env.pop("GPULAB_LDAP_URI")
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.split()[:2] == ["None", "None"]


def test_a_wrong_service_password_is_named_not_a_500(
    slapd: Slapd,
    settings: SettingsWrapper,
    monkeypatch: pytest.MonkeyPatch,
    db: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    use_directory(
        settings,
        monkeypatch,
        {**slapd.settings(), **MAPPING, "GPULAB_LDAP_BIND_PASSWORD": "not-it"},
    )
    _, response = sign_in("dora", "dora-pw-1")
    assert response.status_code == 200
    page = response.content.decode()
    assert (
        f"the lab&#x27;s directory at {slapd.uri} failed: Invalid credentials" in page
    )
    assert f"the lab's directory at {slapd.uri} failed" in caplog.text
    assert not User.objects.filter(username="dora").exists()


def test_a_local_account_is_not_taken_over_by_the_directory(directory: Slapd) -> None:
    """A directory user with a local admin's name does not become that admin."""
    local = User.objects.create_user(
        "dora", password="local-pw-12", is_staff=True, is_superuser=True
    )
    _, response = sign_in("dora", "dora-pw-1")
    assert response.status_code == 200
    assert "a local gpulab account is already named" in response.content.decode()
    local.refresh_from_db()
    assert local.is_superuser
    assert not Membership.objects.filter(user=local).exists()
    # The local password still works; once it is removed the directory has it.
    assert sign_in("dora", "local-pw-12")[1].status_code == 302
    local.set_unusable_password()
    local.save()
    assert sign_in("dora", "dora-pw-1")[1].status_code == 302
    assert memberships(local) == {"vision": True}


def test_a_user_disabled_in_the_directory_is_deactivated(
    slapd: Slapd, settings: SettingsWrapper, monkeypatch: pytest.MonkeyPatch, db: None
) -> None:
    """The user filter leaves disabled accounts out (here: a nologin shell)."""
    use_directory(
        settings,
        monkeypatch,
        {
            **slapd.settings(),
            **MAPPING,
            "GPULAB_LDAP_USER_FILTER": "(&(objectClass=posixAccount)(uid=%(user)s)"
            "(!(loginShell=/usr/sbin/nologin)))",
        },
    )
    assert sign_in("dora", "dora-pw-1")[1].status_code == 302
    slapd.modify(
        f"dn: uid=dora,{PEOPLE}\nchangetype: modify\nreplace: loginShell\n"
        "loginShell: /usr/sbin/nologin\n"
    )
    assert refresh_ldap_users()["deactivated"] == 1
    assert User.objects.get(username="dora").is_active is False
    assert sign_in("dora", "dora-pw-1")[1].status_code == 200
    # Enabled again: the refresh gives the account back.
    slapd.modify(
        f"dn: uid=dora,{PEOPLE}\nchangetype: modify\nreplace: loginShell\n"
        "loginShell: /bin/bash\n"
    )
    refresh_ldap_users()
    assert User.objects.get(username="dora").is_active is True
    assert sign_in("dora", "dora-pw-1")[1].status_code == 302
