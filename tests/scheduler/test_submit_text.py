"""What is accepted is what runs and what is shown (``validate_job_request``, the
one copy of the rules the form, the API, the CLI and the admin console share):
environment names the shell keeps, bidirectional controls refused in labels and
kept (to be marked) in commands, working directories normalised and limited to
``GPULAB_WORKDIR_ALLOWED``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.core.exceptions import ValidationError

from scheduler import services
from scheduler.models import Job
from scheduler.services import JobRequest

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE


def request(**overrides: Any) -> JobRequest:
    fields: dict[str, Any] = {
        "name": "resnet",
        "command": "python train.py",
        "workdir": "/home/alice/resnet",
    }
    return JobRequest(**(fields | overrides))


def refusal(alice: User, **overrides: Any) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, request(**overrides))
    assert Job.objects.count() == 0
    return {k: " ".join(v) for k, v in caught.value.message_dict.items()}


# ------------------------------------------------------------------ environment


@pytest.mark.parametrize(
    "name",
    ["FOO\n", "FOO\r\n", "\nFOO", "FO O", "FOO=BAR", "FÖO", "", "FOO\u202e"],
    ids=["trailing-newline", "crlf", "leading-newline", "space", "equals",
         "non-ascii", "empty", "bidi"],
)  # fmt: skip
def test_an_env_name_the_shell_would_drop_is_refused_by_name(
    alice: User, cluster: list[Any], name: str
) -> None:
    # "FOO\n" passed the old check (``$`` matches before a final newline) and
    # /bin/sh then dropped it from the job's environment without a word.
    errors = refusal(alice, env={name: "1"})

    assert repr(name) in errors["env"]
    assert "not a valid environment variable name" in errors["env"]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("a\x00b", "NUL"),
        ("\x1b[2J", "U+001B"),
        ("a\x7fb", "U+007F"),
        ("a\x85b", "U+0085"),
        ("\ud800", "UTF-8"),
    ],
    ids=["nul", "escape", "del", "c1-nel", "surrogate"],
)
def test_an_env_value_with_a_control_character_is_refused_naming_it(
    alice: User, cluster: list[Any], value: str, says: str
) -> None:
    errors = refusal(alice, env={"SEED": value})

    assert "The value of SEED" in errors["env"]
    assert says in errors["env"]


def test_env_values_the_shell_keeps_are_stored_exactly(
    alice: User, cluster: list[Any]
) -> None:
    env = {"MULTI": "line one\nline two\tand a tab\r\n", "BIDI": f"x{RLO}y"}

    job = services.submit_job(alice, request(env=env))

    assert Job.objects.get(pk=job.pk).env == env


# ------------------------------------------------------------------ bidi controls


BIDI = [
    "\u202a",
    "\u202b",
    "\u202c",
    "\u202d",
    "\u202e",
    "\u2066",
    "\u2067",
    "\u2068",
    "\u2069",
    "\u200e",
    "\u200f",
    "\u061c",
]


@pytest.mark.parametrize("ch", BIDI, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize("field", ["name", "workload"])
def test_a_bidi_control_in_a_label_is_refused_naming_it(
    alice: User, cluster: list[Any], field: str, ch: str
) -> None:
    errors = refusal(alice, **{field: f"job{ch}gnp.exe"})

    assert f"U+{ord(ch):04X}" in errors[field]
    assert "bidirectional control" in errors[field]


def test_a_bidi_control_in_a_command_is_kept_exactly(
    alice: User, cluster: list[Any]
) -> None:
    # A command runs verbatim (RTL text in an argument may need them); pages, the
    # CLI and notifications show it with the character marked instead.
    command = f"echo 'שלום{RLO}' # {RLO}exe.png"

    job = services.submit_job(alice, request(command=command))

    assert Job.objects.get(pk=job.pk).command == command


# ------------------------------------------------------------------ workdir


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("/tmp/a/../b", "/tmp/b"),
        ("/home/alice/./runs/", "/home/alice/runs"),
        ("//home///alice", "/home/alice"),
        ("/scratch/x/y/../..", "/scratch"),
        ("  /data/set  ", "/data/set"),
    ],
)
def test_the_workdir_is_stored_normalised(
    alice: User, cluster: list[Any], given: str, stored: str
) -> None:
    job = services.submit_job(alice, request(workdir=given))

    assert Job.objects.get(pk=job.pk).workdir == stored


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("/tmp/../../../../etc", "/etc"),
        ("/home/../etc/cron.d", "/etc/cron.d"),
        ("/tmpfoo", "/tmpfoo"),  # a prefix is a directory, not a string
        ("/", "/"),
        ("/var/../root/.ssh", "/root/.ssh"),
    ],
)
def test_a_workdir_outside_the_allowed_directories_is_refused_by_name(
    alice: User, cluster: list[Any], given: str, normal: str
) -> None:
    errors = refusal(alice, workdir=given)

    assert f"The working directory {normal} is outside" in errors["workdir"]
    assert "/home, /scratch, /data, /tmp" in errors["workdir"]


def test_the_allowed_directories_are_a_setting(
    alice: User, cluster: list[Any], settings: Any
) -> None:
    settings.GPULAB_WORKDIR_ALLOWED = ["/lab"]

    assert "outside" in refusal(alice, workdir="/home/alice")["workdir"]
    job = services.submit_job(alice, request(workdir="/lab/x/../y"))
    assert job.workdir == "/lab/y"
    settings.GPULAB_WORKDIR_ALLOWED = ["/"]
    assert services.submit_job(alice, request(workdir="/etc")).workdir == "/etc"


def test_a_default_workdir_outside_names_the_setting(
    alice: User, cluster: list[Any], settings: Any
) -> None:
    settings.GPULAB_DEFAULT_WORKDIR = "/srv/{user}"

    errors = refusal(alice, workdir="")

    assert "/srv/alice (GPULAB_DEFAULT_WORKDIR) is outside" in errors["workdir"]


@pytest.mark.parametrize("given", ["/tmp/a\x00b", "tmp/../etc", "../tmp"])
def test_a_workdir_with_nul_or_relative_is_refused(
    alice: User, cluster: list[Any], given: str
) -> None:
    errors = refusal(alice, workdir=given)

    assert "NUL" in errors["workdir"] or "absolute" in errors["workdir"]


def test_the_admin_consoles_change_is_normalised_and_checked_too(
    alice: User, cluster: list[Any]
) -> None:
    job = services.submit_job(alice, request())

    cleaned = services.validate_request_change(job, {"workdir": "/tmp/x/../y"})
    assert cleaned == {"workdir": "/tmp/y"}
    with pytest.raises(ValidationError) as caught:
        services.validate_request_change(
            job, {"workdir": "/tmp/../etc", "env": {"A\n": "1"}}
        )
    assert set(caught.value.message_dict) == {"workdir", "env"}
