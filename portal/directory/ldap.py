"""LDAP sign-in (django-auth-ldap) and the directory look-ups that keep accounts in
step.

django-auth-ldap finds the user (``AUTH_LDAP_USER_SEARCH``: the search base and
``GPULAB_LDAP_USER_FILTER``), checks the password by binding as them and creates
the gpulab account at the first sign-in. ``DirectoryBackend`` then reads the rest
with the service account: the user's posixAccount attributes (uid, uidNumber,
gidNumber) and the groups that name them (a posixGroup's ``memberUid``, a
groupOfNames' ``member``), and applies them (``identity.apply_identity``).

An unreachable or failing server is reported on the request
(``directory_error``), which the login form shows naming the server, and logged;
sign-in then goes on to the other backends (a local break-glass admin still
signs in).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ldap  # type: ignore[import-untyped]
from django.conf import settings
from django_auth_ldap.backend import (  # type: ignore[import-untyped]
    LDAPBackend,
    ldap_error,
)
from django_auth_ldap.config import LDAPSearch  # type: ignore[import-untyped]

from portal.directory.identity import (
    DirectoryIdentity,
    IdentityRefused,
    apply_identity,
)
from scheduler.models import Profile

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from django.contrib.auth.models import User
    from django.http import HttpRequest

log = logging.getLogger(__name__)

# Groups that name a user: posixGroup by memberUid, groupOfNames by member DN.
GROUP_FILTER = (
    "(|(&(objectClass=posixGroup)(memberUid=%(uid)s))"
    "(&(objectClass=groupOfNames)(member=%(dn)s)))"
)
USER_ATTRS = ["uid", "uidNumber", "gidNumber", "mail", "givenName", "sn", "cn"]


class DirectoryUnavailable(Exception):
    """The LDAP server could not be reached or refused the service account."""


def describe_error(exc: BaseException) -> str:
    """The server and what went wrong, for the login page and the log."""
    uri = settings.GPULAB_LDAP_URI
    if isinstance(exc, ldap.SERVER_DOWN | ldap.TIMEOUT):
        return f"the lab's directory at {uri} could not be reached"
    detail = ""
    if exc.args and isinstance(exc.args[0], dict):
        detail = str(exc.args[0].get("desc", ""))
    return f"the lab's directory at {uri} failed: {detail or type(exc).__name__}"


def _first(attrs: Mapping[str, Sequence[str]], name: str) -> str:
    values = attrs.get(name) or []
    return str(values[0]) if values else ""


def _number(attrs: Mapping[str, Sequence[str]], name: str, dn: str) -> int | None:
    value = _first(attrs, name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ldap: %s has a %s that is not a number: %r", dn, name, value)
        return None


def connect() -> Any:
    """A connection bound as the service account (``LDAPError`` if not)."""
    connection = ldap.initialize(settings.GPULAB_LDAP_URI, bytes_mode=False)
    for option, value in settings.AUTH_LDAP_CONNECTION_OPTIONS.items():
        connection.set_option(option, value)
    if settings.AUTH_LDAP_START_TLS:
        connection.start_tls_s()
    connection.simple_bind_s(
        settings.AUTH_LDAP_BIND_DN, settings.AUTH_LDAP_BIND_PASSWORD
    )
    return connection


def find_user(
    connection: Any, username: str
) -> tuple[str, Mapping[str, Sequence[str]]] | None:
    """The user's DN and attributes, or None when the user filter matches no one
    (removed, or disabled if the filter excludes disabled accounts)."""
    search = LDAPSearch(
        settings.GPULAB_LDAP_USER_SEARCH_BASE,
        ldap.SCOPE_SUBTREE,
        settings.GPULAB_LDAP_USER_FILTER,
        USER_ATTRS,
    )
    results = list(search.execute(connection, {"user": username}))
    if len(results) != 1:
        return None
    dn, attrs = results[0]
    return dn, attrs


def identity_of(
    connection: Any, username: str, dn: str, attrs: Mapping[str, Sequence[str]]
) -> DirectoryIdentity:
    """What the directory says of ``username`` (found at ``dn`` with ``attrs``):
    its posixAccount numbers and the groups naming it (``LDAPError`` passes)."""
    unix_name = _first(attrs, "uid")
    groups: set[str] = set()
    gids: list[int] = []
    base = settings.GPULAB_LDAP_GROUP_SEARCH_BASE
    if base:
        search = LDAPSearch(base, ldap.SCOPE_SUBTREE, GROUP_FILTER, ["cn", "gidNumber"])
        for group_dn, group_attrs in search.execute(
            connection, {"uid": unix_name or username, "dn": dn}
        ):
            name = _first(group_attrs, "cn")
            if name:
                groups.add(name)
            gid = _number(group_attrs, "gidNumber", group_dn)
            if gid is not None:
                gids.append(gid)
    uid = _number(attrs, "uidNumber", dn)
    gid = _number(attrs, "gidNumber", dn)
    if uid is None or gid is None:
        # Without both numbers a job runs under the name only (the node resolves it).
        uid = gid = None
        gids = []
    return DirectoryIdentity(
        username=username,
        source="ldap",
        email=_first(attrs, "mail"),
        first_name=_first(attrs, "givenName"),
        last_name=_first(attrs, "sn"),
        groups=frozenset(groups),
        unix_name=unix_name.lower() if unix_name else "",
        uid=uid,
        gid=gid,
        gids=tuple(sorted(set(gids))),
    )


class DirectoryBackend(LDAPBackend):  # type: ignore[misc]
    """django-auth-ldap's backend, with the account made to match the directory at
    each sign-in (groups, staff, Unix account); a user deactivated in gpulab is
    not signed in, nor kept signed in."""

    def ldap_to_django_username(self, username: str) -> str:
        return username.strip().lower()

    def get_or_build_user(self, username: str, ldap_user: Any) -> tuple[User, bool]:
        """django-auth-ldap's, except that a local account (one with a password
        stored in gpulab, not yet signed in through the directory) is not taken
        over: a directory user named ``admin`` must not become the local admin."""
        user, built = super().get_or_build_user(username, ldap_user)
        if not built and user.has_usable_password():
            source = (
                Profile.objects.filter(user=user)
                .values_list("directory", flat=True)
                .first()
            )
            if source != Profile.Directory.LDAP:
                log.warning(
                    "ldap: %s is a local account with its own password; the"
                    " directory's %s may not sign in as it (remove its password"
                    " to hand it to the directory)",
                    username,
                    ldap_user.dn,
                )
                request = getattr(ldap_user, "_request", None)
                if request is not None:
                    request.directory_error = (
                        f"a local gpulab account is already named {username!r};"
                        " ask the lab's admin"
                    )
                raise ldap_user.AuthenticationFailed("a local account has the name")
        return user, built

    def authenticate_ldap_user(self, ldap_user: Any, password: str) -> User | None:
        user: User | None = super().authenticate_ldap_user(ldap_user, password)
        if user is None:
            return None
        request = getattr(ldap_user, "_request", None)
        try:
            # The connection is bound as the service account again.
            identity = identity_of(
                ldap_user.connection, user.get_username(), ldap_user.dn, ldap_user.attrs
            )
        except ldap.LDAPError as exc:
            _report(request, exc)
            return None
        try:
            apply_identity(user, identity)
        except IdentityRefused as exc:
            log.error("ldap: sign-in of %s refused: %s", user.get_username(), exc)
            if request is not None:
                request.directory_error = (
                    f"your directory account cannot be used here ({exc}); ask the"
                    " lab's admin"
                )
            return None
        return user if user.is_active else None

    def get_user(self, user_id: int) -> User | None:
        user: User | None = super().get_user(user_id)
        return user if user is not None and user.is_active else None


def _report(request: HttpRequest | None, exc: BaseException) -> None:
    message = describe_error(exc)
    log.error("ldap: %s: %r", message, exc)
    if request is not None:
        request.directory_error = message  # type: ignore[attr-defined]


def _on_ldap_error(
    sender: Any,
    context: str,
    user: Any,
    request: HttpRequest | None,
    exception: BaseException,
    **kwargs: Any,
) -> None:
    """django-auth-ldap caught an ``LDAPError`` (and returned no user)."""
    _report(request, exception)


ldap_error.connect(_on_ldap_error, dispatch_uid="gpulab-directory-ldap-error")
