"""The periodic refresh: every account signed in through LDAP is looked up again,
so a group change, a new uid or a removal reaches gpulab without a sign-in."""

from __future__ import annotations

import logging
from typing import Any

import ldap  # type: ignore[import-untyped]
from celery import shared_task
from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import Q

from portal.directory import ldap as directory
from portal.directory.identity import (
    IdentityRefused,
    apply_identity,
    deactivate_user,
)
from scheduler.models import Profile

log = logging.getLogger(__name__)

GONE = (
    "no longer found in the directory (removed, or disabled: not matched by"
    " GPULAB_LDAP_USER_FILTER)"
)


def refresh_ldap_users() -> dict[str, int]:
    """Look every LDAP-sourced account up again (one service connection): found ->
    ``apply_identity``; not found -> ``deactivate_user`` (once). An unreachable
    server stops the refresh and changes nothing (an outage must not lock
    everyone out); it is logged naming the server. Returns counts."""
    counts = {"checked": 0, "changed": 0, "deactivated": 0}
    users = User.objects.filter(gpulab__directory=Profile.Directory.LDAP).filter(
        Q(is_active=True) | Q(gpulab__directory_disabled=True)
    )
    if not users.exists():
        return counts
    try:
        connection = directory.connect()
    except ldap.LDAPError as exc:
        log.error(
            "directory refresh skipped: %s: %r", directory.describe_error(exc), exc
        )
        return counts
    try:
        for user in list(users.order_by("pk")):
            username = user.get_username()
            try:
                found = directory.find_user(connection, username)
                identity = (
                    None
                    if found is None
                    else directory.identity_of(connection, username, *found)
                )
            except ldap.LDAPError as exc:
                log.error(
                    "directory refresh stopped at %s: %s: %r",
                    username,
                    directory.describe_error(exc),
                    exc,
                )
                break
            counts["checked"] += 1
            if identity is None:
                if user.is_active:
                    deactivate_user(user, GONE)
                    counts["deactivated"] += 1
                continue
            try:
                if apply_identity(user, identity):
                    counts["changed"] += 1
            except IdentityRefused as exc:
                log.error("directory refresh: %s left as it was: %s", username, exc)
    finally:
        connection.unbind_s()
    log.info("directory refresh: %s", counts)
    return counts


@shared_task(ignore_result=True)
def refresh(**kwargs: Any) -> dict[str, int]:
    """Celery beat's entry (``GPULAB_LDAP_REFRESH_INTERVAL``)."""
    if not settings.GPULAB_LDAP_URI:
        return {}
    return refresh_ldap_users()
