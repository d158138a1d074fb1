"""Settings of what a job request may ask for (``scheduler.services.jobs``)."""

from __future__ import annotations

import posixpath

from django.core.exceptions import ImproperlyConfigured

from portal.settings_env import envlist

__all__ = ["GPULAB_WORKDIR_ALLOWED"]


def _workdir_prefixes(name: str, default: list[str]) -> list[str]:
    """Absolute directories, normalised; '/' allows any directory."""
    prefixes = envlist(name, default)
    if not prefixes:
        raise ImproperlyConfigured(
            f"{name} is empty; list the allowed directories (/ allows any)"
        )
    for prefix in prefixes:
        if not prefix.startswith("/") or "\x00" in prefix:
            raise ImproperlyConfigured(
                f"{name}: {prefix!r} is not an absolute directory"
            )
    return [posixpath.normpath("/" + p.lstrip("/")) for p in prefixes]


# A job's working directory, once normalised (``..`` and ``.`` resolved), must be
# one of these directories or lie under one of them (comma-separated; "/" allows
# any). The default covers home directories, the usual shared scratch and data
# file systems, and /tmp (the default working directory, used by the demo).
GPULAB_WORKDIR_ALLOWED = _workdir_prefixes(
    "GPULAB_WORKDIR_ALLOWED", ["/home", "/scratch", "/data", "/tmp"]
)
