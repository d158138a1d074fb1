"""The OpenAPI schema is the contract: what the server accepts, the schema calls
valid, and what the server refuses, the schema calls invalid wherever a schema
can say so. Each example is sent to the server (real PostgreSQL and Redis) and
validated against the served schema with an ECMA-262 regex engine
(``jsonschema_rs``, as schemathesis validates), so the two cannot drift apart.

Refusals a schema cannot state (the cluster's size, group membership, jobs
that exist, one field against another) are listed apart: the schema calls
them valid and the server names the field."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jsonschema_rs
import pytest
from django.conf import settings
from django.test import Client

from scheduler.models import Job

if TYPE_CHECKING:
    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db

JOB = {"name": "resnet", "command": "python train.py"}

ACCEPTED: list[dict[str, Any]] = [
    JOB,
    {**JOB, "name": "x" * 128},
    {**JOB, "name": "  spaced  ", "workdir": "  /home/alice  "},
    {**JOB, "name": "Ünïcødé ✓ 名前", "workload": "bert\u00a0large"},
    {**JOB, "command": "set -e\n\tpython a.py\r\n"},
    {**JOB, "workdir": "", "gpu_model": "", "workload": "", "group": ""},
    {**JOB, "workdir": "   "},
    {**JOB, "gpus": 1, "gpu_memory_mib": 1, "time_limit_s": 1},
    {**JOB, "gpus": 6, "time_limit_s": 7 * 24 * 3600},
    {**JOB, "gpu_model": "A100", "gpu_memory_mib": 81920},
    {**JOB, "kill_grace_s": 0},
    {**JOB, "kill_grace_s": 3600},
    {**JOB, "priority_class": "high", "time_limit_s": 3600},
    {**JOB, "priority_class": "best-effort", "time_limit_s": 14 * 24 * 3600},
    {**JOB, "priority_class": ""},
    {**JOB, "shareable": True, "slowdown_cap": 1},
    {**JOB, "shareable": True, "slowdown_cap": 1.25},
    {**JOB, "shareable": False, "evictable": False, "requeue_on_node_loss": False},
    {**JOB, "env": {}},
    {**JOB, "env": {"A": "", "B_2": "line\nbreak\ttab", "_X": "ü"}},
    {**JOB, "env": {f"V{i}": "1" for i in range(200)}},
    {**JOB, "gpu_memory_mib": None, "time_limit_s": None, "kill_grace_s": None},
    {**JOB, "slowdown_cap": None},
    {**JOB, "interactive": ""},
    # interactive jobs: gpulab writes the name, command and class
    {"interactive": "jupyter"},
    {"interactive": "shell", "name": "debug", "gpus": 2, "time_limit_s": 3600},
    {"interactive": "jupyter", "shareable": True, "workdir": "/home/alice"},
]

# (body, the field the server names): each also invalid under the schema.
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"command": "c"}, "name"),
    ({"name": "n"}, "command"),
    ({"interactive": "jupyter", "command": "true"}, "command"),
    ({"interactive": "jupyter", "env": {}}, "env"),
    ({"interactive": "shell", "priority_class": "high"}, "priority_class"),
    ({"interactive": "vnc"}, "interactive"),
    ({**JOB, "priority_class": "interactive"}, "priority_class"),
    ({**JOB, "name": ""}, "name"),
    ({**JOB, "name": "   "}, "name"),
    ({**JOB, "name": "x" * 129}, "name"),
    ({**JOB, "name": "tab\there"}, "name"),
    ({**JOB, "name": "ends\n"}, "name"),
    ({**JOB, "name": "job\u202egnp.exe"}, "name"),
    ({**JOB, "name": "a\u0085b"}, "name"),
    ({**JOB, "name": 5}, "name"),
    ({**JOB, "command": ""}, "command"),
    ({**JOB, "command": " \n\t "}, "command"),
    ({**JOB, "command": "echo \x1b[31m"}, "command"),
    ({**JOB, "command": "x" * 16385}, "command"),
    ({**JOB, "workdir": "relative/path"}, "workdir"),
    ({**JOB, "workdir": "/tmp/\x01"}, "workdir"),
    ({**JOB, "workdir": "/" + "a" * 1024}, "workdir"),
    ({**JOB, "env": "A=1"}, "env"),
    ({**JOB, "env": {"A": 1}}, "env.A"),
    ({**JOB, "env": {"A": "\x00"}}, "env.A"),
    ({**JOB, "env": {"A": "\x1b"}}, "env.A"),
    ({**JOB, "env": {f"V{i}": "1" for i in range(201)}}, "env"),
    ({**JOB, "gpus": 0}, "gpus"),
    ({**JOB, "gpus": -1}, "gpus"),
    ({**JOB, "gpus": 1025}, "gpus"),
    ({**JOB, "gpus": 2**31}, "gpus"),
    ({**JOB, "gpus": True}, "gpus"),
    ({**JOB, "gpus": "2"}, "gpus"),
    ({**JOB, "gpus": 2.0}, "gpus"),
    ({**JOB, "gpus": None}, "gpus"),
    ({**JOB, "gpu_memory_mib": 0}, "gpu_memory_mib"),
    ({**JOB, "gpu_memory_mib": 2**31}, "gpu_memory_mib"),
    ({**JOB, "gpu_model": "x" * 65}, "gpu_model"),
    ({**JOB, "gpu_model": "A\x00"}, "gpu_model"),
    ({**JOB, "time_limit_s": 0}, "time_limit_s"),
    ({**JOB, "time_limit_s": 14 * 24 * 3600 + 1}, "time_limit_s"),
    ({**JOB, "time_limit_s": "3600"}, "time_limit_s"),
    ({**JOB, "priority_class": "urgent"}, "priority_class"),
    ({**JOB, "priority_class": "High"}, "priority_class"),
    ({**JOB, "priority_class": None}, "priority_class"),
    ({**JOB, "shareable": "yes"}, "shareable"),
    ({**JOB, "shareable": 1}, "shareable"),
    ({**JOB, "shareable": None}, "shareable"),
    ({**JOB, "evictable": "false"}, "evictable"),
    ({**JOB, "requeue_on_node_loss": 0}, "requeue_on_node_loss"),
    ({**JOB, "shareable": True, "slowdown_cap": 0.5}, "slowdown_cap"),
    ({**JOB, "shareable": True, "slowdown_cap": True}, "slowdown_cap"),
    ({**JOB, "shareable": True, "slowdown_cap": "1.5"}, "slowdown_cap"),
    ({**JOB, "workload": "x" * 129}, "workload"),
    ({**JOB, "workload": "a\nb"}, "workload"),
    ({**JOB, "workload": "\u2066x"}, "workload"),
    ({**JOB, "group": "g" * 65}, "group"),
    ({**JOB, "kill_grace_s": -1}, "kill_grace_s"),
    ({**JOB, "kill_grace_s": 3601}, "kill_grace_s"),
    ({**JOB, "kill_grace_s": False}, "kill_grace_s"),
    ({**JOB, "after": "x" * 10_001}, "after"),
    ({**JOB, "after": ["12"]}, "after"),
]

# Refusals the schema cannot state: it calls these valid.
BEYOND_SCHEMA: list[tuple[dict[str, Any], str, str]] = [
    ({**JOB, "gpus": 7}, "gpus", "the cluster's size"),
    ({**JOB, "gpu_memory_mib": 81921}, "gpu_memory_mib", "the largest GPU"),
    ({**JOB, "gpu_model": "H100"}, "gpu_model", "the GPUs present"),
    ({**JOB, "group": "nlp"}, "group", "membership"),
    ({**JOB, "after": "afterok:999999"}, "after", "jobs that exist"),
    ({**JOB, "after": "sometime"}, "after", "the dependency grammar"),
    ({**JOB, "slowdown_cap": 1.5}, "slowdown_cap", "needs shareable"),
    (
        {**JOB, "priority_class": "high", "time_limit_s": 4 * 24 * 3600},
        "time_limit_s",
        "the class's own limit",
    ),
    ({**JOB, "env": {"1BAD": "x"}}, "env", "variable names"),
    ({**JOB, "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env", "reserved names"),
]

ARRAYS_ACCEPTED = ["0-3", "0-99%8", " 1, 3 ,5-7 %2 ", "0-10:5%1", "0-3%1000", "7"]
ARRAYS_REFUSED = ["", "x", "0-3%", "0-3%0x", "0-3%²", "²", "0-٣", "1;2", "0-3%-1"]
ARRAYS_BEYOND_SCHEMA = ["3-1", "1,1", "0-1000", "2000000", "0-3%0", "0-3%1001"]


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` as JSON Schema (draft 4) says it."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable"):
        return {"anyOf": [out, {"type": "null"}]}
    return out


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    got = Client().get("/api/v1/schema/", {"format": "json"})
    assert got.status_code == 200
    return dict(got.json())


def _validator(schema: dict[str, Any], name: str) -> Any:
    root = {
        "$ref": f"#/components/schemas/{name}",
        "components": _nullable(schema["components"]),
    }
    return jsonschema_rs.Draft4Validator(root)


def test_the_request_limits_are_stated(schema: dict[str, Any]) -> None:
    props = schema["components"]["schemas"]["JobRequestRequest"]["properties"]
    assert props["name"]["maxLength"] == 128
    assert (props["gpus"]["minimum"], props["gpus"]["maximum"]) == (1, 1024)
    assert props["kill_grace_s"]["maximum"] == 3600
    assert props["time_limit_s"]["maximum"] == 14 * 24 * 3600
    assert props["env"]["maxProperties"] == 200
    params = schema["paths"]["/api/v1/jobs/"]["get"]["parameters"]
    by_name = {p["name"]: p["schema"] for p in params}
    assert by_name["limit"]["maximum"] == settings.GPULAB_API_MAX_PAGE
    assert by_name["offset"]["maximum"] == settings.GPULAB_API_MAX_OFFSET
    assert (by_name["before"]["minimum"], by_name["before"]["maximum"]) == (1, 2**62)
    queue = schema["paths"]["/api/v1/queue/"]["get"]["parameters"]
    assert {p["name"]: p["schema"]["maximum"] for p in queue} == {
        "limit": settings.GPULAB_API_MAX_PAGE,
        "offset": settings.GPULAB_API_MAX_OFFSET,
    }
    state = next(p for p in params if p["name"] == "state")
    assert "active" in state["schema"]["items"]["enum"]
    assert "running" in state["schema"]["items"]["enum"]
    assert state["explode"] is False


@pytest.mark.parametrize("data", ACCEPTED)
def test_what_the_server_accepts_the_schema_calls_valid(
    as_alice: Api, cluster: list[Node], schema: dict[str, Any], data: dict[str, Any]
) -> None:
    got = as_alice.post("/api/v1/jobs/", data)
    assert got.status_code == 201, got.json()
    errors = [
        e.message for e in _validator(schema, "JobRequestRequest").iter_errors(data)
    ]
    assert not errors


@pytest.mark.parametrize(("data", "field"), REFUSED)
def test_what_the_server_refuses_the_schema_calls_invalid(
    as_alice: Api,
    cluster: list[Node],
    schema: dict[str, Any],
    data: dict[str, Any],
    field: str,
) -> None:
    got = as_alice.post("/api/v1/jobs/", data)
    assert got.status_code == 400
    assert field in got.json()["fields"], got.json()
    assert not _validator(schema, "JobRequestRequest").is_valid(data)
    assert not Job.objects.exists()


@pytest.mark.parametrize(("data", "field", "why"), BEYOND_SCHEMA)
def test_refusals_beyond_the_schema_name_the_field(
    as_alice: Api,
    cluster: list[Node],
    schema: dict[str, Any],
    data: dict[str, Any],
    field: str,
    why: str,
) -> None:
    got = as_alice.post("/api/v1/jobs/", data)
    assert got.status_code == 400
    assert field in got.json()["fields"], got.json()
    assert _validator(schema, "JobRequestRequest").is_valid(data), why


@pytest.mark.parametrize("spec", ARRAYS_ACCEPTED)
def test_array_specs_the_server_accepts(
    as_alice: Api, cluster: list[Node], schema: dict[str, Any], spec: str
) -> None:
    data = {**JOB, "array": spec}
    got = as_alice.post("/api/v1/arrays/", data)
    assert got.status_code == 201, got.json()
    assert _validator(schema, "ArrayRequestRequest").is_valid(data)


@pytest.mark.parametrize("spec", ARRAYS_REFUSED)
def test_array_specs_the_server_refuses(
    as_alice: Api, cluster: list[Node], schema: dict[str, Any], spec: str
) -> None:
    data = {**JOB, "array": spec}
    got = as_alice.post("/api/v1/arrays/", data)
    assert got.status_code == 400
    assert "array" in got.json()["fields"]
    assert not _validator(schema, "ArrayRequestRequest").is_valid(data)


@pytest.mark.parametrize("spec", ARRAYS_BEYOND_SCHEMA)
def test_array_rules_beyond_the_schema(
    as_alice: Api, cluster: list[Node], schema: dict[str, Any], spec: str
) -> None:
    """Order, repeats, counts and the limit's range: not a regular language's
    business (or a setting's)."""
    data = {**JOB, "array": spec}
    got = as_alice.post("/api/v1/arrays/", data)
    assert got.status_code == 400
    assert "array" in got.json()["fields"]
    assert _validator(schema, "ArrayRequestRequest").is_valid(data)


@pytest.mark.parametrize(
    ("state", "expect"),
    [
        ("pending", 200),
        ("pending,running", 200),
        ("active,completed", 200),
        ("Pending", 400),
        ("pending, running", 400),
        ("pending,", 400),
        ("sleeping", 400),
    ],
)
def test_the_state_filter_is_the_schemas_enum(
    as_alice: Api, schema: dict[str, Any], state: str, expect: int
) -> None:
    params = schema["paths"]["/api/v1/jobs/"]["get"]["parameters"]
    item = next(p for p in params if p["name"] == "state")["schema"]
    valid = jsonschema_rs.Draft4Validator(item).is_valid(state.split(","))
    got = as_alice.get("/api/v1/jobs/", state=state)
    assert (valid, got.status_code) == (expect == 200, expect), got.json()
    if expect == 400:
        assert "state" in got.json()["fields"]
