"""services.submit_job: bad input is refused field by field and writes nothing;
good input stores a PENDING job and asks for a scheduling pass after commit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError

from scheduler import services
from scheduler.models import Job, JobEvent, Membership, Profile
from scheduler.services import JobRequest

if TYPE_CHECKING:
    from tests.capture import Broker

pytestmark = pytest.mark.django_db


WEEK = 7 * 24 * 3600


def request(**overrides: Any) -> JobRequest:
    fields: dict[str, Any] = {
        "name": "resnet",
        "command": "python train.py --epochs 10",
        "workdir": "/home/alice/resnet",
    }
    fields.update(overrides)
    return JobRequest(**fields)


BAD_INPUT = [
    pytest.param({"gpus": 0}, "gpus", "at least one GPU", id="zero-gpus"),
    pytest.param({"gpus": -2}, "gpus", "at least one GPU", id="negative-gpus"),
    pytest.param({"gpus": 7}, "gpus", "6 GPU(s) in all", id="more-than-cluster"),
    pytest.param(
        {"gpu_memory_mib": 81921}, "gpu_memory_mib", "81920 MiB", id="memory-too-big"
    ),
    pytest.param({"gpu_memory_mib": 0}, "gpu_memory_mib", "positive", id="memory-0"),
    pytest.param(
        {"priority_class": "urgent"}, "priority_class", "'urgent'", id="unknown-class"
    ),
    pytest.param({"command": ""}, "command", "empty", id="empty-command"),
    pytest.param({"command": " \n\t "}, "command", "empty", id="blank-command"),
    pytest.param({"command": "ls\x00-l"}, "command", "NUL", id="nul-in-command"),
    pytest.param(
        {"command": "echo \x1b[31m"}, "command", "U+001B", id="control-in-command"
    ),
    pytest.param({"command": "echo \ud800"}, "command", "UTF-8", id="surrogate-cmd"),
    pytest.param({"name": "a\x00b"}, "name", "NUL", id="nul-in-name"),
    pytest.param({"name": "a\nb"}, "name", "control characters", id="newline-name"),
    pytest.param({"name": "a\x07b"}, "name", "U+0007", id="control-in-name"),
    pytest.param({"name": "\udfffx"}, "name", "UTF-8", id="surrogate-in-name"),
    pytest.param({"name": "   "}, "name", "name", id="blank-name"),
    pytest.param({"workdir": "data/run"}, "workdir", "absolute", id="relative-dir"),
    pytest.param(
        {"env": {"CUDA_VISIBLE_DEVICES": "0"}},
        "env",
        "CUDA_VISIBLE_DEVICES",
        id="reserved-cuda-env",
    ),
    pytest.param({"env": {"GPULAB_X": "1"}}, "env", "GPULAB_X", id="reserved-prefix"),
    pytest.param({"env": {"1BAD": "1"}}, "env", "'1BAD'", id="bad-env-name"),
    pytest.param(
        {"time_limit_s": WEEK + 1}, "time_limit_s", "at most 168 h", id="too-long"
    ),
    pytest.param({"time_limit_s": 0}, "time_limit_s", "positive", id="zero-limit"),
    pytest.param({"group": "nlp"}, "group", "'nlp'", id="not-my-group"),
    pytest.param({"group": "nosuch"}, "group", "'nosuch'", id="unknown-group"),
    pytest.param(
        {"slowdown_cap": 1.2}, "slowdown_cap", "may share", id="cap-not-shareable"
    ),
    pytest.param(
        {"slowdown_cap": 0.9, "shareable": True},
        "slowdown_cap",
        "1 or more",
        id="cap-below-1",
    ),
    pytest.param(
        {"slowdown_cap": float("nan"), "shareable": True},
        "slowdown_cap",
        "1 or more",
        id="cap-nan",
    ),
    pytest.param(
        {"slowdown_cap": 2.0, "shareable": True},
        "slowdown_cap",
        "already caps slowdowns at 1.5x",
        id="cap-looser-than-class",
    ),
]


@pytest.mark.parametrize(("overrides", "field", "says"), BAD_INPUT)
def test_it_refuses_bad_input_by_field_and_stores_nothing(
    alice: User, cluster: list[Any], overrides: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, request(**overrides))

    assert field in caught.value.message_dict
    assert says in " ".join(caught.value.message_dict[field])
    assert Job.objects.count() == 0
    assert JobEvent.objects.count() == 0


def test_it_refuses_a_command_over_the_byte_limit(
    alice: User, cluster: list[Any]
) -> None:
    limit = settings.GPULAB_MAX_COMMAND_BYTES
    # Two-byte characters: the limit is in UTF-8 bytes, not characters.
    command = "é" * (limit // 2 + 1)

    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, request(command=command))

    message = " ".join(caught.value.message_dict["command"])
    assert f"{limit + 2} bytes" in message
    assert f"limit is {limit} bytes" in message
    assert Job.objects.count() == 0


def test_it_accepts_a_command_of_exactly_the_byte_limit(
    alice: User, cluster: list[Any]
) -> None:
    command = "x" * settings.GPULAB_MAX_COMMAND_BYTES

    job = services.submit_job(alice, request(command=command))

    assert len(job.command) == settings.GPULAB_MAX_COMMAND_BYTES


def test_it_names_every_problem_at_once(alice: User, cluster: list[Any]) -> None:
    bad = request(name="", command="", workdir="rel", gpus=0, priority_class="x")

    with pytest.raises(ValidationError) as caught:
        services.validate_job_request(bad)

    assert set(caught.value.message_dict) == {
        "name",
        "command",
        "workdir",
        "gpus",
        "priority_class",
    }


def test_it_says_no_node_is_registered(alice: User) -> None:
    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, request())

    assert "No GPU node has registered yet" in caught.value.message_dict["gpus"][0]
    assert Job.objects.count() == 0


def test_it_ignores_gpus_that_are_gone_when_checking_capacity(
    alice: User, cluster: list[Any]
) -> None:
    node_a = cluster[0]
    node_a.gpus.filter(index__gte=2).update(present=False)

    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, request(gpus=5))

    assert caught.value.message_dict["gpus"] == ["The cluster has 4 GPU(s) in all."]


def test_it_accepts_a_job_larger_than_any_node_it_will_span_nodes(
    alice: User, cluster: list[Any]
) -> None:
    """The foundation refused these; jobs now span nodes (torchrun ranks)."""
    job = services.submit_job(alice, request(gpus=5))

    assert job.status == Job.Status.PENDING
    assert job.gpus == 5


def test_it_stores_a_pending_job_with_the_class_default_time_limit(
    alice: User, cluster: list[Any], groups: dict[str, Any]
) -> None:
    job = services.submit_job(alice, request(gpus=2, env={"GPULAB_SIM_UTIL": "50"}))

    job.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert job.owner == alice
    assert job.group == groups["vision"]
    assert job.gpus == 2
    assert job.priority_class == settings.GPULAB_DEFAULT_CLASS
    normal = settings.GPULAB_PRIORITY_CLASSES["normal"]
    assert job.time_limit_s == normal["default_time_limit"]
    assert job.env == {"GPULAB_SIM_UTIL": "50"}


def test_it_writes_a_submit_event(alice: User, cluster: list[Any]) -> None:
    job = services.submit_job(alice, request())

    [event] = JobEvent.objects.filter(job=job)
    assert event.actor == alice
    assert event.source == JobEvent.Source.USER
    assert event.to_status == Job.Status.PENDING
    assert "alice" in event.message


def test_it_charges_the_named_group(cluster: list[Any], groups: dict[str, Any]) -> None:
    user = User.objects.create_user("dora")
    Membership.objects.create(user=user, group=groups["vision"])
    Membership.objects.create(user=user, group=groups["nlp"])

    job = services.submit_job(user, request(group="nlp"))

    assert job.group == groups["nlp"]


def test_it_charges_the_primary_group_by_default(
    cluster: list[Any], groups: dict[str, Any]
) -> None:
    user = User.objects.create_user("dora")
    Membership.objects.create(user=user, group=groups["vision"])
    Membership.objects.create(user=user, group=groups["nlp"])
    Profile.objects.create(user=user, primary_group=groups["vision"])

    job = services.submit_job(user, request())

    assert job.group == groups["vision"]  # not nlp, the first by name


def test_a_primary_group_the_user_left_is_not_charged(
    cluster: list[Any], groups: dict[str, Any]
) -> None:
    user = User.objects.create_user("dora")
    Membership.objects.create(user=user, group=groups["nlp"])
    Profile.objects.create(user=user, primary_group=groups["vision"])

    job = services.submit_job(user, request())

    assert job.group == groups["nlp"]


def test_it_puts_a_user_without_group_in_the_default_group(
    cluster: list[Any],
) -> None:
    loner = User.objects.create_user("loner")

    job = services.submit_job(loner, request())

    job.refresh_from_db()
    assert job.group.name == settings.GPULAB_DEFAULT_GROUP
    assert Membership.objects.filter(user=loner, group=job.group).exists()


def test_it_enqueues_a_schedule_pass_only_on_commit(
    alice: User,
    cluster: list[Any],
    django_capture_on_commit_callbacks: Any,
    passes: Broker,
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        services.submit_job(alice, request())
        assert passes.tasks() == []

    assert passes.tasks() == ["scheduler.tasks.schedule_pass"]


def test_it_enqueues_nothing_for_bad_input(
    alice: User, cluster: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(ValidationError):
            services.submit_job(alice, request(gpus=99))
        with pytest.raises(ValidationError):
            services.submit_job(alice, request(group="nlp"))

    assert callbacks == []


@pytest.mark.parametrize("grace", [-1, services.MAX_KILL_GRACE_S + 1])
def test_it_refuses_a_stop_grace_out_of_range(
    alice: User, cluster: list[Any], grace: int
) -> None:
    with pytest.raises(ValidationError) as caught:
        services.submit_job(alice, request(kill_grace_s=grace))

    assert "grace period" in caught.value.message_dict["kill_grace_s"][0]
    assert not Job.objects.exists()


def test_it_keeps_the_jobs_own_stop_grace_and_node_loss_choice(
    alice: User, cluster: list[Any], settings: Any
) -> None:
    settings.GPULAB_KILL_GRACE = 30

    mine = services.submit_job(
        alice, request(kill_grace_s=5, requeue_on_node_loss=False)
    )
    default = services.submit_job(alice, request())

    assert (mine.kill_grace_s, mine.requeue_on_node_loss) == (5, False)
    assert (default.kill_grace_s, default.requeue_on_node_loss) == (30, True)


def test_it_keeps_the_jobs_own_sharing_terms(alice: User, cluster: list[Any]) -> None:
    mine = services.submit_job(
        alice, request(shareable=True, slowdown_cap=1.2, evictable=False)
    )
    scavenger = services.submit_job(
        alice,
        request(shareable=True, slowdown_cap=3.0, priority_class="best-effort"),
    )

    assert (mine.slowdown_cap, mine.evictable) == (1.2, False)
    assert scavenger.slowdown_cap == 3.0  # its class has no cap: any is tighter


def test_the_default_workdir_names_the_user(
    alice: User, cluster: list[Any], settings: Any
) -> None:
    settings.GPULAB_DEFAULT_WORKDIR = "/home/{user}/runs"

    job = services.submit_job(alice, request(workdir=""))

    assert job.workdir == "/home/alice/runs"
