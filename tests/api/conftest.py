"""API fixtures: a personal token per persona and clients that send it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client

from portal.api import tokens

if TYPE_CHECKING:
    from django.contrib.auth.models import User


class Api:
    """A client that authenticates with a token and speaks JSON."""

    def __init__(self, secret: str | None) -> None:
        self.client = Client()
        self.headers = {"Authorization": f"Bearer {secret}"} if secret else {}

    def get(self, path: str, **params: Any) -> Any:
        return self.client.get(path, params, headers=self.headers)

    def post(self, path: str, data: Any = None, **kw: Any) -> Any:
        return self.client.post(
            path,
            data if data is not None else {},
            content_type=kw.pop("content_type", "application/json"),
            headers={**self.headers, **kw.pop("headers", {})},
            **kw,
        )


def api_for(user: User | None) -> Api:
    if user is None:
        return Api(None)
    _token, secret = tokens.create_token(user, "tests", None)
    return Api(secret)


@pytest.fixture
def as_alice(alice: User) -> Api:
    return api_for(alice)


@pytest.fixture
def as_bob(bob: User) -> Api:
    return api_for(bob)


@pytest.fixture
def as_charlie(charlie: User) -> Api:
    return api_for(charlie)


@pytest.fixture
def as_admin(admin_user: User) -> Api:
    return api_for(admin_user)
