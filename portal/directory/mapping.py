"""Which directory groups are which gpulab groups, which make a group leader and
which make staff: parsed from the environment at start (``portal.settings_directory``),
so a wrong value stops the process with a message naming the setting.

Formats (comma-separated; directory group names compare case-insensitively, as LDAP
compares a ``cn``; an OIDC groups claim value such as ``/lab/vision`` works the same):

- ``GPULAB_DIRECTORY_GROUP_MAP``: ``directory-group=gpulab-group`` pairs, e.g.
  ``vision-lab=vision,nlp-lab=nlp,nlp-students=nlp``;
- ``GPULAB_DIRECTORY_LEADER_GROUPS``: the same pairs; a member of the directory group
  is a member and leader of the gpulab group, e.g. ``vision-pis=vision``;
- ``GPULAB_DIRECTORY_STAFF_GROUPS``: directory groups whose members are staff.

This module imports nothing of Django's models: the settings import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

# A gpulab group's name is a slug of at most 64 characters (scheduler.Group.name).
_SLUG = re.compile(r"^[-a-zA-Z0-9_]{1,64}$")


def _fold(name: str) -> str:
    return name.strip().casefold()


def parse_pairs(setting: str, value: str) -> dict[str, frozenset[str]]:
    """``a=x,b=y,a=z`` -> {"a": {"x", "z"}, "b": {"y"}} (keys case-folded);
    ``ImproperlyConfigured`` naming ``setting`` and the bad entry."""
    pairs: dict[str, set[str]] = {}
    for entry in value.split(","):
        if not entry.strip():
            continue
        directory_group, sep, gpulab_group = entry.rpartition("=")
        directory_group, gpulab_group = directory_group.strip(), gpulab_group.strip()
        if not sep or not directory_group or not gpulab_group:
            raise ImproperlyConfigured(
                f"{setting}: {entry.strip()!r} is not directory-group=gpulab-group"
                " (e.g. vision-lab=vision)"
            )
        if not _SLUG.match(gpulab_group):
            raise ImproperlyConfigured(
                f"{setting}: {gpulab_group!r} (in {entry.strip()!r}) is not a gpulab"
                " group name (letters, digits, - and _, at most 64)"
            )
        pairs.setdefault(_fold(directory_group), set()).add(gpulab_group)
    return {key: frozenset(groups) for key, groups in pairs.items()}


def parse_names(setting: str, value: str) -> frozenset[str]:
    """``a,b`` -> {"a", "b"} (case-folded); an entry with ``=`` is refused (the
    value of a pairs setting put in the wrong variable)."""
    names = set()
    for entry in value.split(","):
        if not entry.strip():
            continue
        if "=" in entry:
            raise ImproperlyConfigured(
                f"{setting}: {entry.strip()!r} should be a directory group name"
                " (this setting takes names only, e.g. gpulab-admins)"
            )
        names.add(_fold(entry))
    return frozenset(names)


@dataclass(frozen=True)
class GroupMapping:
    """The three mapping settings, parsed."""

    groups: Mapping[str, frozenset[str]] = field(default_factory=dict)
    leaders: Mapping[str, frozenset[str]] = field(default_factory=dict)
    staff: frozenset[str] = frozenset()

    @classmethod
    def parse(
        cls, group_map: str, leader_groups: str, staff_groups: str
    ) -> GroupMapping:
        return cls(
            groups=parse_pairs("GPULAB_DIRECTORY_GROUP_MAP", group_map),
            leaders=parse_pairs("GPULAB_DIRECTORY_LEADER_GROUPS", leader_groups),
            staff=parse_names("GPULAB_DIRECTORY_STAFF_GROUPS", staff_groups),
        )

    def managed(self) -> frozenset[str]:
        """The gpulab groups whose membership the directory decides (a hand-made
        membership of any other group is left alone)."""
        out: set[str] = set()
        for targets in (*self.groups.values(), *self.leaders.values()):
            out |= targets
        return frozenset(out)

    def memberships(self, directory_groups: Iterable[str]) -> dict[str, bool]:
        """gpulab group -> is_leader, for a user in ``directory_groups``."""
        folded = {_fold(g) for g in directory_groups}
        out: dict[str, bool] = {}
        for key in folded:
            for target in self.groups.get(key, ()):
                out.setdefault(target, False)
            for target in self.leaders.get(key, ()):
                out[target] = True
        return out

    def is_staff(self, directory_groups: Iterable[str]) -> bool | None:
        """True/False, or None when no staff groups are configured (then the
        directory leaves the staff flag as an admin set it)."""
        if not self.staff:
            return None
        return any(_fold(g) in self.staff for g in directory_groups)
