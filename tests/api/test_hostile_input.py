"""Input an attacker or a careless script sends: each is a 400 in the API's one
error body naming what is wrong, never a 500 with a traceback in the log, and
nothing is stored. Types are strict: JSON's booleans, numbers and strings are
not taken for one another."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from portal import units
from scheduler import services
from scheduler.models import Job, JobArray

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db

JOB = {"name": "resnet", "command": "python train.py", "workdir": "/home/alice"}
MANY = "&".join(f"p{i}=1" for i in range(1001))


def _refused(got: Any, field: str, code: str = "invalid") -> dict[str, Any]:
    assert got.status_code == 400, got.content[:300]
    assert got["Content-Type"].startswith("application/json")
    body: dict[str, Any] = got.json()
    assert set(body) == {"error", "detail", "fields"}
    assert body["error"] == code, body
    assert field in body["fields"], body
    return body


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


# ------------------------------------------------------------------ query parameters


@pytest.mark.parametrize("path", ["/api/v1/jobs/", "/api/v1/me/", "/api/v1/queue/"])
def test_too_many_query_parameters_with_a_token(
    as_alice: Api, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        got = as_alice.client.get(f"{path}?{MANY}", headers=as_alice.headers)
    body = _refused(got, "query")
    assert "1000" in body["fields"]["query"][0]
    _no_traceback(caplog)


@pytest.mark.parametrize("path", ["/api/v1/jobs/", "/api/v1/schema/", "/api/v1/docs/"])
def test_too_many_query_parameters_without_a_token(
    db: None, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        got = Client().get(f"{path}?{MANY}")
    _refused(got, "query")
    _no_traceback(caplog)


def test_a_thousand_query_parameters_are_still_read(as_alice: Api) -> None:
    few = "&".join(f"p{i}=1" for i in range(1000))
    got = as_alice.client.get(f"/api/v1/jobs/?{few}", headers=as_alice.headers)
    assert got.status_code == 200


# ------------------------------------------------------------------ JSON depth


def _nested(depth: int) -> str:
    """``{"env": {"A": [[...]]}}`` with ``depth`` levels in all."""
    inner = "[" * (depth - 2) + "]" * (depth - 2)
    return '{"name": "n", "command": "c", "env": {"A": ' + inner + "}}"


@pytest.mark.parametrize("path", ["/api/v1/jobs/", "/api/v1/arrays/"])
@pytest.mark.parametrize("depth", [33, 941, 5000, 100_000])
def test_json_nested_too_deep(
    as_alice: Api,
    cluster: list[Node],
    path: str,
    depth: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        got = as_alice.post(path, _nested(depth))
    body = _refused(got, "env", code="parse_error")
    assert "32 levels" in body["detail"]
    _no_traceback(caplog)
    assert not Job.objects.exists()


def test_json_depth_is_counted_outside_strings_only(
    as_alice: Api, cluster: list[Node]
) -> None:
    """Brackets inside strings (escaped quotes too) are text, not nesting."""
    command = 'echo "[[[[{{{{" ' + "[" * 100 + '\\"' + "{" * 100
    got = as_alice.post("/api/v1/jobs/", {**JOB, "command": command})
    assert got.status_code == 201, got.json()
    assert Job.objects.get().command == command


def test_json_at_the_depth_limit_is_parsed(as_alice: Api, cluster: list[Node]) -> None:
    """32 levels parse; the field's own type check answers."""
    got = as_alice.post("/api/v1/jobs/", _nested(32))
    body = _refused(got, "env.A")
    assert body["fields"]["env.A"] == ["Must be a string."]


def test_a_deep_array_at_the_top_names_the_body(
    as_alice: Api, cluster: list[Node]
) -> None:
    got = as_alice.post("/api/v1/jobs/", "[" * 2000 + "]" * 2000)
    _refused(got, "body", code="parse_error")


@pytest.mark.parametrize(
    ("content_type", "raw", "code"),
    [
        # Django ignores a charset it does not know: read as UTF-8
        ("application/json; charset=nonsense", b'{"name": "n"}', "invalid"),
        ("application/json", b'{"name": "\xff"}', "parse_error"),
        (
            "application/json",
            b'{"name": "n", "command": "c", "gpus": NaN}',
            "parse_error",
        ),
    ],
)
def test_a_body_that_cannot_be_read_is_a_400(
    as_alice: Api,
    cluster: list[Node],
    content_type: str,
    raw: bytes,
    code: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        got = as_alice.client.generic(
            "POST",
            "/api/v1/jobs/",
            raw,
            content_type=content_type,
            headers=as_alice.headers,
        )
    assert got.status_code == 400, got.content[:300]
    assert got.json()["error"] == code
    _no_traceback(caplog)


# ------------------------------------------------------------------ array specs


@pytest.mark.parametrize(
    "spec",
    [
        "0-3%2147483648",  # over PostgreSQL's integer
        "0-3%99999999999999999999999",
        "0-3%" + "9" * 5000,  # over Python's int() digit limit
        "0-3%1001",  # over GPULAB_MAX_ARRAY_SIZE
        "0-3%²",  # isdigit() says yes, int() says no
        "0-3%٣",  # an Arabic-Indic three: int() reads it, we do not
        "0-3%+3",
        "0-3%0",
        "0-3%-1",
    ],
)
def test_a_bad_array_limit_is_a_400(
    as_alice: Api, cluster: list[Node], spec: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        got = as_alice.post("/api/v1/arrays/", {**JOB, "array": spec})
    _refused(got, "array")
    _no_traceback(caplog)
    assert not JobArray.objects.exists()
    # the one parser (the API's pattern refuses most of these before it)
    with pytest.raises(ValidationError) as err:
        services.parse_array_spec(spec)
    assert "limit after % is a whole number from 1 to 1000" in str(err.value)


@pytest.mark.parametrize("spec", ["²", "1-²", "0-٣", "\uff11", "0-3:²"])
def test_unicode_digits_in_array_indexes_are_a_400(
    as_alice: Api, cluster: list[Node], spec: str
) -> None:
    got = as_alice.post("/api/v1/arrays/", {**JOB, "array": spec})
    _refused(got, "array")


def test_the_largest_array_limit_is_accepted(
    as_alice: Api, cluster: list[Node]
) -> None:
    got = as_alice.post("/api/v1/arrays/", {**JOB, "array": "0-3%1000"})
    assert got.status_code == 201, got.json()
    assert got.json()["max_running"] == 1000


# ------------------------------------------------------------------ strict types


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # no boolean as a number
        ("gpus", True),
        ("gpu_memory_mib", True),
        ("time_limit_s", False),
        ("kill_grace_s", True),
        ("slowdown_cap", True),
        # no string or fraction as an integer
        ("gpus", "2"),
        ("gpus", 2.0),
        ("gpus", 1.5),
        ("time_limit_s", "3600"),
        # no string or non-finite value as a number
        ("slowdown_cap", "1.5"),
        ("slowdown_cap", "nan"),
        ("slowdown_cap", "Infinity"),
        # no number or string as a boolean
        ("shareable", "yes"),
        ("shareable", 1),
        ("evictable", "false"),
        ("evictable", 0),
        ("requeue_on_node_loss", "on"),
        ("requeue_on_node_loss", 1.0),
        # no number, boolean or list as a string
        ("name", 5),
        ("command", True),
        ("workdir", ["/tmp"]),
        ("after", 12),
        # no list or string as a mapping; no number as its value
        ("env", "A=1"),
        ("env", [["A", "1"]]),
    ],
)
def test_each_field_has_its_json_type(
    as_alice: Api, cluster: list[Node], field: str, value: Any
) -> None:
    data = {**JOB, "shareable": True, "slowdown_cap": 1.5, field: value}
    got = as_alice.post("/api/v1/jobs/", data)
    _refused(got, field)
    assert not Job.objects.exists()


def test_env_values_are_strings(as_alice: Api, cluster: list[Node]) -> None:
    for value in (1, True, None, ["x"]):
        got = as_alice.post("/api/v1/jobs/", {**JOB, "env": {"A": value}})
        _refused(got, "env.A")


def test_a_non_finite_json_number_is_refused(
    as_alice: Api, cluster: list[Node]
) -> None:
    """Python's json reads NaN and Infinity; JSON has neither."""
    raw = '{"name": "n", "command": "c", "shareable": true, "slowdown_cap": NaN}'
    got = as_alice.post("/api/v1/jobs/", raw)
    assert got.status_code == 400
    assert got.json()["error"] in {"parse_error", "invalid"}


def test_the_right_types_are_accepted(as_alice: Api, cluster: list[Node]) -> None:
    data = {
        **JOB,
        "gpus": 2,
        "gpu_memory_mib": 1024,
        "time_limit_s": 3600,
        "kill_grace_s": 10,
        "shareable": True,
        "slowdown_cap": 1,  # an integer is a number
        "evictable": False,
        "requeue_on_node_loss": False,
        "env": {"A": "1"},
    }
    got = as_alice.post("/api/v1/jobs/", data)
    assert got.status_code == 201, got.json()
    job = Job.objects.get()
    assert (job.gpus, job.slowdown_cap, job.evictable) == (2, 1.0, False)


def test_null_is_refused_where_a_field_has_no_null(
    as_alice: Api, cluster: list[Node]
) -> None:
    for field in ("gpus", "shareable", "workdir", "env"):
        got = as_alice.post("/api/v1/jobs/", {**JOB, field: None})
        _refused(got, field)


# ------------------------------------------------------------------ the web forms


@pytest.mark.parametrize(
    ("text", "parse"),
    [
        ("²", units.parse_duration),
        ("1:²:00", units.parse_duration),
        ("9" * 5000, units.parse_duration),
        ("²", units.parse_memory_mib),
        ("9" * 400, units.parse_memory_mib),  # a float of inf
        ("9" * 400 + "G", units.parse_memory_mib),
    ],
)
def test_units_refuse_unicode_digits_and_huge_numbers(text: str, parse: Any) -> None:
    with pytest.raises(ValueError, match="Write a"):
        parse(text)


def test_the_submit_form_names_a_huge_amount(
    alice: User, cluster: list[Node], client: Client
) -> None:
    client.force_login(alice)
    got = client.post(
        "/jobs/new/",
        {"name": "n", "command": "c", "gpus": "1", "gpu_memory": "9" * 400},
    )
    assert got.status_code == 400  # the form again, its errors shown
    assert "Write an amount like" in got.content.decode()
    assert not Job.objects.exists()


@pytest.mark.parametrize("copy", ["²", "99999999999999999999999"])
def test_the_submit_page_ignores_a_bad_copy_id(
    alice: User, cluster: list[Node], client: Client, copy: str
) -> None:
    client.force_login(alice)
    assert client.get("/jobs/new/", {"copy": copy}).status_code == 200


@pytest.mark.parametrize("grace", ["²", "9" * 5000])
def test_the_submit_form_names_a_bad_kill_grace(
    alice: User, cluster: list[Node], client: Client, grace: str
) -> None:
    client.force_login(alice)
    got = client.post(
        "/jobs/new/",
        {"name": "n", "command": "c", "gpus": "1", "kill_grace": grace},
    )
    assert got.status_code == 400  # the form again, its errors shown
    assert "Write a duration like" in got.content.decode()
    assert not Job.objects.exists()


@pytest.mark.parametrize("text", ["²", "a²", "٣"])
def test_the_cli_refuses_unicode_digits_in_ids(text: str) -> None:
    import click

    from portal.cli.jobs import parse_id

    with pytest.raises(click.BadParameter, match="is not a job id"):
        parse_id(text)
