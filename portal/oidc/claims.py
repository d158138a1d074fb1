"""The provider's claims as a ``DirectoryIdentity``: which claim says what comes from
the settings (``GPULAB_OIDC_*_CLAIM``); a required claim that is missing or of the
wrong type refuses the sign-in with a message naming the claim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings

from portal.directory.identity import DirectoryIdentity

if TYPE_CHECKING:
    from collections.abc import Mapping

# Django's own username rule (letters, digits and @.+-_), at most 150 characters.
_USERNAME = re.compile(r"^[\w.@+-]{1,150}$")
# The Unix account name rule of scheduler.Profile.unix_account.
_UNIX_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,30}\$?$")
# Unix ids: 32 bits, 0xFFFFFFFF is (uid_t)-1.
_ID_MAX = 2**32 - 2


class ClaimError(Exception):
    """A claim the sign-in needs is missing or unusable; the message names it."""

    def __init__(self, claim: str, problem: str) -> None:
        super().__init__(f"The identity provider's claim {claim!r} {problem}")
        self.claim = claim


@dataclass(frozen=True)
class ClaimNames:
    username: str = "preferred_username"
    groups: str = "groups"  # "" or "-": not read
    unix_name: str = ""
    uid: str = ""
    gid: str = ""
    gids: str = ""
    active: str = ""

    @classmethod
    def from_settings(cls) -> ClaimNames:
        return cls(
            username=settings.GPULAB_OIDC_USERNAME_CLAIM,
            groups=settings.GPULAB_OIDC_GROUPS_CLAIM,
            unix_name=settings.GPULAB_OIDC_UNIX_NAME_CLAIM,
            uid=settings.GPULAB_OIDC_UID_CLAIM,
            gid=settings.GPULAB_OIDC_GID_CLAIM,
            gids=settings.GPULAB_OIDC_GIDS_CLAIM,
            active=settings.GPULAB_OIDC_ACTIVE_CLAIM,
        )


def identity_from_claims(
    claims: Mapping[str, Any], names: ClaimNames
) -> DirectoryIdentity:
    username = _string(claims, names.username, required=True)
    if not _USERNAME.match(username):
        raise ClaimError(
            names.username,
            f"is {username!r}, not a user name (letters, digits and @.+-_,"
            " at most 150)",
        )
    unix_name = _string(claims, names.unix_name, required=bool(names.unix_name))
    if unix_name and not _UNIX_NAME.match(unix_name):
        raise ClaimError(
            names.unix_name,
            f"is {unix_name!r}, not a Unix account name (lower-case letters,"
            " digits, _ and -, at most 32)",
        )
    uid = _number(claims, names.uid)
    if uid == 0:
        raise ClaimError(names.uid, "is 0 (root): jobs never run as root")
    return DirectoryIdentity(
        username=username,
        source="oidc",
        email=_string(claims, "email", required=False),
        first_name=_string(claims, "given_name", required=False)[:150],
        last_name=_string(claims, "family_name", required=False)[:150],
        groups=_groups(claims, names.groups),
        unix_name=unix_name,
        uid=uid,
        gid=_number(claims, names.gid),
        gids=_numbers(claims, names.gids),
        active=_active(claims, names.active),
    )


def _string(claims: Mapping[str, Any], name: str, *, required: bool) -> str:
    if not name:
        return ""
    value = claims.get(name)
    if value is None or value == "":
        if required:
            raise ClaimError(name, "is missing from the provider's answer")
        return ""
    if not isinstance(value, str):
        raise ClaimError(name, f"should be a string, not {_kind(value)}")
    return value.strip()


def _groups(claims: Mapping[str, Any], name: str) -> frozenset[str]:
    if name in ("", "-"):
        return frozenset()
    if name not in claims:
        raise ClaimError(
            name,
            "is missing from the provider's answer (add the groups mapper, or set"
            " GPULAB_OIDC_GROUPS_CLAIM to the claim that lists the user's groups)",
        )
    value = claims[name]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ClaimError(name, f"should be a list of group names, not {_kind(value)}")
    return frozenset(v.strip() for v in value if v.strip())


def _id(name: str, value: Any) -> int:
    """A Unix id from an int or a string of digits (providers often send user
    attributes as strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ClaimError(name, f"should be a number, not {_kind(value)}")
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise ClaimError(name, f"is {value!r}, not a number")
        value = int(value.strip())
    if not 0 <= value <= _ID_MAX:
        raise ClaimError(name, f"is {value}, outside 0..{_ID_MAX}")
    return int(value)


def _number(claims: Mapping[str, Any], name: str) -> int | None:
    if not name:
        return None
    if claims.get(name) in (None, ""):
        raise ClaimError(name, "is missing from the provider's answer")
    return _id(name, claims[name])


def _numbers(claims: Mapping[str, Any], name: str) -> tuple[int, ...]:
    if not name:
        return ()
    if name not in claims or claims[name] is None:
        raise ClaimError(name, "is missing from the provider's answer")
    value = claims[name]
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        # One value, or a comma-separated string of them.
        items: list[Any] = (
            [v for v in value.split(",") if v.strip()]
            if isinstance(value, str)
            else [value]
        )
    elif isinstance(value, list):
        items = value
    else:
        raise ClaimError(name, f"should be a list of numbers, not {_kind(value)}")
    return tuple(_id(name, item) for item in items)


def _active(claims: Mapping[str, Any], name: str) -> bool:
    if not name:
        return True
    value = claims.get(name)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ClaimError(
            name,
            "is missing from the provider's answer"
            if value is None
            else f"should be true or false, not {_kind(value)}",
        )
    return value


def _kind(value: Any) -> str:
    """The JSON type of a claim's value, for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, list):
        return "a list with other things than strings"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
