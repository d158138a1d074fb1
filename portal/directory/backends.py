"""Sign-in with a password stored in gpulab, limited by ``GPULAB_LOCAL_LOGIN``:
``all`` (default), ``staff`` (a break-glass admin only, once the lab signs in
through its directory) or ``off``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.auth.backends import ModelBackend

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.http import HttpRequest

log = logging.getLogger(__name__)


def local_login_allowed(user: User) -> bool:
    mode = settings.GPULAB_LOCAL_LOGIN
    if mode == "all":
        return True
    if mode == "staff":
        return user.is_staff
    return False


class LocalBackend(ModelBackend):
    """Django's password backend, refusing whom ``GPULAB_LOCAL_LOGIN`` leaves out
    (they sign in through the directory instead)."""

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> User | None:
        user = super().authenticate(request, username, password, **kwargs)
        if user is not None and not local_login_allowed(user):
            log.info(
                "local sign-in of %s refused (GPULAB_LOCAL_LOGIN=%s)",
                user.get_username(),
                settings.GPULAB_LOCAL_LOGIN,
            )
            return None
        return user
