"""The API accepts only what runs as asked (issue 27) and shows every field of the
request back: an environment name the shell would drop, a bidirectional control
in a label or a working directory outside the allowed ones is a 400 naming the
field; an accepted job's representation carries each field it was given."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from scheduler.models import Job

if TYPE_CHECKING:
    from scheduler.models import Node
    from tests.api.conftest import Api

pytestmark = pytest.mark.django_db

JOB = {"name": "resnet", "command": "python train.py", "workdir": "/home/alice"}


@pytest.mark.parametrize(
    ("data", "field", "says"),
    [
        ({"env": {"FOO\n": "1"}}, "env", "'FOO\\n' is not a valid environment"),
        ({"env": {"SEED": "\x1b[2J"}}, "env", "U+001B"),
        ({"name": "job\u202egnp.exe"}, "name", "U+202E"),
        ({"workload": "\u2067resnet"}, "workload", "U+2067"),
        ({"workdir": "/tmp/../../../../etc"}, "workdir", "/etc is outside"),
    ],
    ids=["env-name-newline", "env-value-escape", "name-rlo", "workload-rli", "etc"],
)
def test_what_would_not_run_or_show_as_given_is_a_400(
    as_alice: Api, cluster: list[Node], data: dict[str, Any], field: str, says: str
) -> None:
    got = as_alice.post("/api/v1/jobs/", {**JOB, **data})

    assert got.status_code == 400, got.json()
    body = got.json()
    [(named, messages)] = body["fields"].items()
    assert named.split(".")[0] == field  # env errors name the variable: env.SEED
    assert says in messages[0]
    assert not Job.objects.exists()


def test_every_field_of_the_request_is_shown_back(
    as_alice: Api, cluster: list[Node]
) -> None:
    asked = {
        **JOB,
        "workdir": "/tmp/runs/../resnet/.",
        "env": {"SEED": "1", "NOTE": "two\nlines"},
        "gpus": 2,
        "gpu_memory_mib": 20480,
        "gpu_model": "A100",
        "time_limit_s": 3600,
        "priority_class": "high",
        "shareable": True,
        "slowdown_cap": 1.25,
        "evictable": False,
        "workload": "resnet50",
        "kill_grace_s": 90,
        "requeue_on_node_loss": False,
    }

    got = as_alice.post("/api/v1/jobs/", asked)

    assert got.status_code == 201, got.json()
    shown = as_alice.get(f"/api/v1/jobs/{got.json()['id']}/").json()
    assert shown["workdir"] == "/tmp/resnet"  # normalised, as it runs
    for field, value in asked.items():
        if field != "workdir":
            assert shown[field] == value, field


def test_a_command_with_a_bidi_control_is_shown_exactly(
    as_alice: Api, cluster: list[Node]
) -> None:
    # JSON is for programs: the API keeps the text exact; people's views mark it.
    command = "echo ok # \u202egnp.exe"

    got = as_alice.post("/api/v1/jobs/", {**JOB, "command": command})

    assert got.status_code == 201, got.json()
    assert got.json()["command"] == command
