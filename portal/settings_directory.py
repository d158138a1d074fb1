"""Sign-in from the lab's directory (LDAP) and the mapping of its groups; pulled into
``portal.settings``. LDAP is on only when ``GPULAB_LDAP_URI`` is set."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured

from portal.directory.mapping import GroupMapping
from portal.settings_env import envbool, envchoice, envfloat, envsecret, envstr

# Which directory groups are which gpulab groups, leaders, staff
# (portal.directory.mapping has the formats; LDAP and OpenID Connect share them).
GPULAB_DIRECTORY_MAPPING = GroupMapping.parse(
    envstr("GPULAB_DIRECTORY_GROUP_MAP", ""),
    envstr("GPULAB_DIRECTORY_LEADER_GROUPS", ""),
    envstr("GPULAB_DIRECTORY_STAFF_GROUPS", ""),
)
# A user the directory removed or disabled: their waiting jobs are held; their
# running jobs are left to finish, or cancelled when this is true.
GPULAB_DIRECTORY_CANCEL_RUNNING = envbool(
    "GPULAB_DIRECTORY_CANCEL_RUNNING", default=False
)
# Who may sign in with a password stored in gpulab (not the directory's):
# all (default), staff (a break-glass admin), off (no one).
GPULAB_LOCAL_LOGIN = envchoice("GPULAB_LOCAL_LOGIN", "all", ("all", "staff", "off"))

# ------------------------------------------------------------------ LDAP
# Off unless GPULAB_LDAP_URI is set (ldap://host, ldaps://host:636, ldapi://...).
GPULAB_LDAP_URI = envstr("GPULAB_LDAP_URI", "").strip()
GPULAB_LDAP_USER_SEARCH_BASE = ""
GPULAB_LDAP_USER_FILTER = ""
GPULAB_LDAP_GROUP_SEARCH_BASE = ""
# Sign-in: a local password first (fast, and it works while the directory is
# down), then the directory.
AUTHENTICATION_BACKENDS = ["portal.directory.backends.LocalBackend"]
# The periodic refresh's Celery beat entry (settings.py adds it to its schedule).
DIRECTORY_BEAT_SCHEDULE: dict[str, Any] = {}
CELERY_IMPORTS = ("portal.directory.tasks",)
if GPULAB_LDAP_URI:
    import ldap  # type: ignore[import-untyped]
    from django_auth_ldap.config import LDAPSearch  # type: ignore[import-untyped]

    if not GPULAB_LDAP_URI.startswith(("ldap://", "ldaps://", "ldapi://")):
        raise ImproperlyConfigured(
            f"GPULAB_LDAP_URI={GPULAB_LDAP_URI!r} must start with ldap://, ldaps://"
            " or ldapi://"
        )
    GPULAB_LDAP_USER_SEARCH_BASE = envstr("GPULAB_LDAP_USER_SEARCH_BASE")
    # Who may sign in; %(user)s is the name typed (escaped). Leave out disabled
    # accounts here (e.g. add (!(pwdAccountLockedTime=*))): the refresh deactivates
    # an account the filter no longer matches.
    GPULAB_LDAP_USER_FILTER = envstr(
        "GPULAB_LDAP_USER_FILTER", "(&(objectClass=posixAccount)(uid=%(user)s))"
    )
    if "%(user)s" not in GPULAB_LDAP_USER_FILTER or not (
        GPULAB_LDAP_USER_FILTER.startswith("(")
        and GPULAB_LDAP_USER_FILTER.endswith(")")
    ):
        raise ImproperlyConfigured(
            f"GPULAB_LDAP_USER_FILTER={GPULAB_LDAP_USER_FILTER!r} must be an LDAP"
            " filter in parentheses containing %(user)s"
        )
    # Groups (posixGroup memberUid, groupOfNames member) are searched here; empty:
    # no groups are read (and none mapped).
    GPULAB_LDAP_GROUP_SEARCH_BASE = envstr("GPULAB_LDAP_GROUP_SEARCH_BASE", "")
    AUTH_LDAP_SERVER_URI = GPULAB_LDAP_URI
    # The service account that searches (empty: anonymous binds).
    AUTH_LDAP_BIND_DN = envstr("GPULAB_LDAP_BIND_DN", "")
    AUTH_LDAP_BIND_PASSWORD = envsecret("GPULAB_LDAP_BIND_PASSWORD", "")
    AUTH_LDAP_START_TLS = envbool("GPULAB_LDAP_START_TLS", default=False)
    _ldap_timeout = envfloat("GPULAB_LDAP_TIMEOUT", 5.0, minimum=0.5, maximum=120)
    AUTH_LDAP_CONNECTION_OPTIONS: dict[int, Any] = {
        ldap.OPT_NETWORK_TIMEOUT: _ldap_timeout,
        ldap.OPT_TIMEOUT: _ldap_timeout,
        ldap.OPT_REFERRALS: 0,
    }
    _ca_file = envstr("GPULAB_LDAP_CA_FILE", "")
    if _ca_file:
        AUTH_LDAP_CONNECTION_OPTIONS[ldap.OPT_X_TLS_CACERTFILE] = _ca_file
        AUTH_LDAP_CONNECTION_OPTIONS[ldap.OPT_X_TLS_NEWCTX] = 0
    AUTH_LDAP_USER_SEARCH = LDAPSearch(
        GPULAB_LDAP_USER_SEARCH_BASE, ldap.SCOPE_SUBTREE, GPULAB_LDAP_USER_FILTER
    )
    # Names, e-mail, groups and the Unix account: portal.directory.ldap.
    AUTH_LDAP_USER_ATTR_MAP: dict[str, str] = {}
    AUTH_LDAP_ALWAYS_UPDATE_USER = True
    AUTH_LDAP_CACHE_TIMEOUT = 0
    AUTHENTICATION_BACKENDS.append("portal.directory.ldap.DirectoryBackend")
    # Every LDAP-sourced account is looked up again this often (seconds).
    GPULAB_LDAP_REFRESH_INTERVAL = envfloat(
        "GPULAB_LDAP_REFRESH_INTERVAL", 900.0, minimum=10.0
    )
    DIRECTORY_BEAT_SCHEDULE["directory-refresh"] = {
        "task": "portal.directory.tasks.refresh",
        "schedule": GPULAB_LDAP_REFRESH_INTERVAL,
        "options": {"expires": GPULAB_LDAP_REFRESH_INTERVAL},
    }
