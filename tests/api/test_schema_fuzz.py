"""Every operation of the API's own OpenAPI schema fuzzed with schemathesis, in
process through Django's WSGI app on the real test database and Redis, as a
member and as staff: every check (no server error, status codes, bodies,
content types and headers as the schema says, authentication enforced,
schema-valid data accepted, schema-violating data refused) in every phase
(examples, coverage, fuzzing; coverage as a member only, see ``staff_schema``;
stateful: scenarios chaining operations through the links schemathesis infers),
with positive and negative data, a fixed seed and a bounded number of cases.
``bench/schema_fuzz.py`` runs every phase for both, with more cases, and reports
its figures; ``bench/schema_fuzz_stack.py`` runs schemathesis' own runner
against the real processes (uvicorn, worker, agents).

One exception, stated in ``fuzz_rules.BEYOND_SCHEMA``: schema-valid data that breaks a
rule no schema can state (the cluster's size, group membership, jobs that
exist, one field against another) is refused with a 400 naming that field and
saying why; any other 400 for schema-valid data fails the run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

from portal.api import tokens
from tests.api.fuzz_rules import beyond_schema
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node

# bench/schema_fuzz.py sets more examples and a log of the cases sent
# The submission operations' coverage phase alone sends some 200 requests: on
# a loaded 2-core machine that takes longer than the suite's default limit.
pytestmark = pytest.mark.timeout(900)

SEED = int(os.environ.get("GPULAB_FUZZ_SEED", "27"))
MAX_EXAMPLES = int(os.environ.get("GPULAB_FUZZ_EXAMPLES", "12"))
CASE_LOG = os.environ.get("GPULAB_FUZZ_LOG")


def config(*, coverage: bool = True) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "generation": {"mode": "all", "max-examples": MAX_EXAMPLES},
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": coverage},
                "fuzzing": {"enabled": True},
            },
            "checks": {
                "enabled": True,
                # a body over GPULAB_API_MAX_BODY_BYTES is refused before it
                # is read: a rejection too
                "negative_data_rejection": {
                    "expected-statuses": [
                        *("400", "401", "403", "404", "405", "406", "409"),
                        *("413", "415", "422", "428", "429"),
                    ]
                },
                "positive_data_acceptance": {
                    "expected-statuses": ["2xx", "401", "403", "404", "409", "429"]
                },
            },
        }
    )


# Loaded at collection: serving the schema touches neither the database nor Redis.
# The coverage phase (every boundary and type of every field, some 200 cases
# for a submission, the same for both personas) runs as a member; as staff too
# when GPULAB_FUZZ_FULL is set (bench/schema_fuzz.py), which the suite's time
# cannot afford.
member_schema = schemathesis.openapi.from_wsgi(
    "/api/v1/schema/", get_wsgi_application(), config=config()
)
staff_schema = schemathesis.openapi.from_wsgi(
    "/api/v1/schema/",
    get_wsgi_application(),
    config=config(coverage=bool(os.environ.get("GPULAB_FUZZ_FULL"))),
)
HYPOTHESIS = settings(
    deadline=None,
    database=None,  # the seed alone decides the cases
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)


@pytest.fixture
def keep_connection(db: None) -> Any:
    """As Django's test client does: the WSGI handler's signals must not close
    the test's connection (it holds the test's transaction)."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


def _token(user: User, alice: User, settings: Any) -> str:
    settings.GPULAB_API_RATE_LIMIT = 1_000_000  # the fuzzer is no abuser
    settings.GPULAB_DEVICE_CODE_RATE = 1_000_000
    JobFactory(owner=alice)
    return tokens.create_token(user, "fuzz", None)[1]


@pytest.fixture
def member(
    keep_connection: None, alice: User, cluster: list[Node], settings: Any
) -> str:
    return _token(alice, alice, settings)


@pytest.fixture
def staff(
    keep_connection: None,
    alice: User,
    admin_user: User,
    cluster: list[Node],
    settings: Any,
) -> str:
    return _token(admin_user, alice, settings)


@member_schema.parametrize()
@HYPOTHESIS
def test_no_input_breaks_the_api_for_a_member(case: Any, member: str) -> None:
    _fuzz(case, "member", member)


@staff_schema.parametrize()
@HYPOTHESIS
def test_no_input_breaks_the_api_for_staff(case: Any, staff: str) -> None:
    _fuzz(case, "staff", staff)


def _fuzz(case: Any, who: str, secret: str) -> None:
    auth = {"Authorization": f"Bearer {secret}"}
    response = case.call(headers=auth)
    beyond = beyond_schema(response)
    excluded = [positive_data_acceptance] if beyond else []
    if CASE_LOG:
        _log(case, who, response.status_code, beyond=beyond)
    # The token is named as the schema's bearer auth: "authentication is
    # enforced" probes the call without it and with a wrong one.
    case.validate_response(response, headers=auth, excluded_checks=excluded)


def _log(case: Any, who: str, status: int, *, beyond: bool) -> None:
    meta = case.meta
    record = {
        "operation": case.operation.label,
        "persona": who,
        "phase": meta.phase.name.value if meta else "?",
        "mode": meta.generation.mode.value if meta else "?",
        "status": status,
        "beyond": beyond,
    }
    with Path(CASE_LOG or "").open("a") as f:
        f.write(json.dumps(record) + "\n")


# bench/schema_fuzz.py sets more
STATEFUL_SCENARIOS = int(os.environ.get("GPULAB_FUZZ_SCENARIOS", "8"))


@pytest.mark.parametrize("who", ["member", "staff"])
def test_no_sequence_of_calls_breaks_the_api(
    who: str, keep_connection: None, request: Any
) -> None:
    """The stateful phase: scenarios chaining operations through the links
    schemathesis infers from the schema (a job submitted, then read, held,
    released, cancelled, its logs and events read; an array and its cancel; a
    node and its drain), every check on every step."""
    auth = {"Authorization": f"Bearer {request.getfixturevalue(who)}"}

    class Scenarios(member_schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": auth}

        def validate_response(
            self, response: Any, case: Any, additional_checks: Any = None, **kw: Any
        ) -> None:
            beyond = beyond_schema(response)
            if CASE_LOG:
                _log(case, who, response.status_code, beyond=beyond)
            excluded = [positive_data_acceptance] if beyond else []
            case.validate_response(response, headers=auth, excluded_checks=excluded)

    Scenarios.run(
        settings=settings(
            HYPOTHESIS,
            max_examples=STATEFUL_SCENARIOS,
            stateful_step_count=10,
            derandomize=True,  # fixed cases, as the seed fixes the others'
        )
    )
