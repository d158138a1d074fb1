"""``gpulab show`` prints every field of the request, the working directory as it
runs; text a user gave is printed with bidirectional controls and terminal
escapes marked (``⟨U+202E⟩``), so a name or a command cannot disguise itself or
rewrite the terminal; ``submit`` refuses what the shell would drop, naming the
option."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from agents.jobtext import for_terminal
from scheduler import services
from scheduler.models import Job
from tests.factories import JobFactory

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.cli.conftest import Gpulab

pytestmark = pytest.mark.django_db(transaction=True)

RLO = "\u202e"


def fields_of(stdout: str) -> dict[str, list[str]]:
    got: dict[str, list[str]] = {}
    for line in stdout.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        got.setdefault(key, []).append(value.strip())
    return got


def test_for_terminal_marks_what_a_terminal_would_act_on() -> None:
    text = f"a{RLO}b\x1b[2Jc\rd\r\ne\tf\u0085"

    assert for_terminal(text) == (
        "a\u27e8U+202E\u27e9b\u27e8U+001B\u27e9[2Jc\u27e8U+000D\u27e9d\ne\tf"
        "\u27e8U+0085\u27e9"
    )


def test_show_prints_every_field_of_the_request(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    job = services.submit_job(
        alice,
        services.JobRequest(
            name="eval",
            command="python eval.py",
            workdir="/tmp/a/../eval/",
            gpus=2,
            gpu_model="A100",
            shareable=True,
            slowdown_cap=1.25,
            evictable=False,
            kill_grace_s=90,
            requeue_on_node_loss=False,
            workload="resnet50",
        ),
    )

    got = gpulab("show", str(job.pk), user=alice)

    assert got.exit_code == 0, got.output
    fields = fields_of(got.stdout)
    assert fields["Workdir"] == ["/tmp/eval"]
    assert fields["GPUs"] == ["2 x A100, may share a GPU"]
    assert fields["Slowdown cap"] == ["1.25x"]
    assert fields["If GPU partner suffers"] == ["kept running"]
    assert fields["Stop grace"] == ["90s (SIGTERM, then SIGKILL)"]
    assert fields["If node lost"] == ["failed"]
    assert fields["Workload"] == ["resnet50"]


def test_show_prints_the_defaults_too(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    job = services.submit_job(
        alice, services.JobRequest(name="j", command="true", workdir="/tmp")
    )

    fields = fields_of(gpulab("show", str(job.pk), user=alice).stdout)

    assert fields["Slowdown cap"] == ["the class's"]
    assert fields["If GPU partner suffers"] == ["requeued"]
    assert fields["If node lost"] == ["requeued"]
    assert fields["Stop grace"] == ["30s (SIGTERM, then SIGKILL)"]


def test_show_and_ls_mark_bidi_controls_and_escapes(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    # A name stored before names were checked; a command is kept as given.
    job = JobFactory(
        owner=alice,
        name=f"job{RLO}gnp.exe",
        command=f"rm -rf ~ # {RLO}txt.emdaer\x1b[2K",
        env={"NOTE": f"x{RLO}y"},
    )

    shown = gpulab("show", str(job.pk), user=alice).stdout
    listed = gpulab("ls", user=alice).stdout

    assert RLO not in shown and "\x1b" not in shown
    fields = fields_of(shown)
    assert fields["Job"] == [f"{job.pk}  job\u27e8U+202E\u27e9gnp.exe"]
    assert fields["Command"] == [
        "rm -rf ~ # \u27e8U+202E\u27e9txt.emdaer\u27e8U+001B\u27e9[2K"
    ]
    assert fields["Env"] == ["NOTE=x\u27e8U+202E\u27e9y"]
    assert RLO not in listed
    assert "job\u27e8U+202E\u27e9gnp.exe" in listed


def test_submit_refuses_an_env_name_the_shell_would_drop(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    got = gpulab("submit", "--env", "FO O=1", "--", "true", user=alice)

    assert got.exit_code != 0
    assert "--env" in got.stderr
    assert "'FO O' is not a valid environment variable name" in got.stderr
    assert not Job.objects.exists()
