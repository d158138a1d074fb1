"""Sign-in from the lab's directory (LDAP) and the mapping of its groups; pulled into
``portal.settings``. LDAP is on only when ``GPULAB_LDAP_URI`` is set."""

from __future__ import annotations

from portal.directory.mapping import GroupMapping
from portal.settings_env import envbool, envchoice, envstr

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
