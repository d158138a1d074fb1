"""Every operation of the API's own OpenAPI schema fuzzed with schemathesis, in
process through Django's WSGI app on the real test database and Redis: no input
may give a 500, and every response must match the schema (status codes, bodies,
content types) that the schema promises."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    ignored_auth,
    negative_data_rejection,
    positive_data_acceptance,
)

from portal.api import tokens
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node


# Loaded at collection: serving the schema touches neither the database nor Redis.
schema = schemathesis.openapi.from_wsgi("/api/v1/schema/", get_wsgi_application())


@pytest.fixture
def keep_connection(db: None) -> Any:
    """As Django's test client does: the WSGI handler's signals must not close
    the test's connection (it holds the test's transaction)."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def secret(
    keep_connection: None, alice: User, cluster: list[Node], settings: Any
) -> str:
    settings.GPULAB_API_RATE_LIMIT = 1_000_000  # the fuzzer is no abuser
    settings.GPULAB_DEVICE_CODE_RATE = 1_000_000
    JobFactory(owner=alice)
    return tokens.create_token(alice, "fuzz", None)[1]


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_no_input_breaks_the_api(case: Any, secret: str) -> None:
    # Not "schema-valid data is accepted": the schema gives types only; the rules
    # (a command is not empty, a class exists, ...) are the services', one copy,
    # and refuse such data with a 400 naming the field.
    # A body over the size limit is refused with 413 before it is parsed: a
    # rejection too, which "schema-violating data is rejected" does not list.
    response = case.call(headers={"Authorization": f"Bearer {secret}"})
    # Not "bad auth is refused" here: the token goes in explicitly on every call
    # (tests/api/test_tokens_throttle.py checks unknown, revoked, expired ones).
    excluded = [positive_data_acceptance, ignored_auth]
    if response.status_code == 413:
        excluded.append(negative_data_rejection)
    case.validate_response(response, excluded_checks=excluded)
