"""Typed parsers for settings read from the environment.

Each raises ``ImproperlyConfigured`` naming the variable and what is wrong, so a bad
value stops the process at start instead of misbehaving later (healthchecks style).
"""

from __future__ import annotations

import os
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def envstr(name: str, default: str | None = None) -> str:
    """A string; ``default=None`` makes the variable required."""
    value = os.environ.get(name)
    if value is None or value == "":
        if default is None:
            raise ImproperlyConfigured(f"{name} is not set")
        return default
    return value


def envchoice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-sensitive, as the code compares it)."""
    value = envstr(name, default).strip()
    if value not in choices:
        raise ImproperlyConfigured(
            f"{name}={value!r} is not one of: {', '.join(choices)}"
        )
    return value


def envbool(name: str, *, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(
        f"{name}={value!r} is not a boolean (use one of: true, false, 1, 0, yes, no)"
    )


def envint(
    name: str, default: int, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} must be at least {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number} must be at most {maximum}")
    return number


def envfloat(
    name: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = float(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ImproperlyConfigured(f"{name}={value!r} is not a finite number")
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} must be at least {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number} must be at most {maximum}")
    return number


def envfloat_or_none(
    name: str,
    *,
    default: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float | None:
    """``envfloat`` for a setting that may be off: ``default`` when unset or
    empty, None when "off" (any case), else the number, checked the same way."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value.lower() == "off":
        return None
    return envfloat(name, 0.0, minimum=minimum, maximum=maximum)


def envlist(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def envsecret(name: str, default: str | None = None) -> str:
    """A secret from ``NAME`` or from the file named by ``NAME_FILE`` (Docker secrets)."""
    file_name = os.environ.get(f"{name}_FILE")
    if file_name:
        try:
            secret = Path(file_name).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ImproperlyConfigured(
                f"{name}_FILE={file_name!r} cannot be read: {exc.strerror}"
            ) from None
        if not secret:
            raise ImproperlyConfigured(f"{name}_FILE={file_name!r} is empty")
        return secret
    return envstr(name, default)


def envurl(name: str, schemes: tuple[str, ...]) -> str:
    """A required URL whose scheme is one of ``schemes``."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise ImproperlyConfigured(
            f"{name} is not set. Start the portal with `make up` or run commands "
            f"through `python -m portal.stack.run -- <command>` (both start embedded "
            f"PostgreSQL and Redis), or set {name} to your server "
            f"(e.g. {schemes[0]}://...)."
        )
    scheme = value.split("://", 1)[0].lower() if "://" in value else ""
    if scheme not in schemes:
        # Name the scheme only: the rest of a URL may hold a password.
        got = f"scheme {scheme!r}" if scheme else "no scheme://"
        raise ImproperlyConfigured(
            f"{name} must start with one of {', '.join(s + '://' for s in schemes)};"
            f" it has {got}"
        )
    return value


def envnetworks(name: str) -> tuple[IPv4Network | IPv6Network, ...]:
    """Comma-separated IP networks in CIDR notation (``10.0.0.0/8, ::1/128``; a
    bare address is its own /32 or /128); empty: none."""
    value = os.environ.get(name, "")
    networks = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        try:
            networks.append(ip_network(item, strict=False))
        except ValueError:
            raise ImproperlyConfigured(
                f"{name}: {item!r} is not an IP network in CIDR notation "
                "(e.g. 10.0.0.0/8 or fd00::/8)"
            ) from None
    return tuple(networks)
