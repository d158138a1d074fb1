"""The launch frame carries the owner's Unix account: the name, and the uid, gid
and supplementary gids a directory gave (sent by a real start, read back from the
real channel layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.models import Profile
from scheduler.services import launch_frame
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames


def test_a_start_sends_the_directory_numbers(
    alice: User,
    bob: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    Profile.objects.create(
        user=alice, unix_account="alice", unix_uid=20001, unix_gid=20001,
        unix_gids=[5000, 5001],
    )  # fmt: skip
    Profile.objects.create(user=bob, unix_account="bob")
    with django_capture_on_commit_callbacks(execute=True):
        start_job(JobFactory(owner=alice), cluster[0])
        start_job(JobFactory(owner=bob), cluster[0])
    launches: list[Any] = [f["data"] for _, f in sent.of_type("job.launch")]
    by_name = {data["run_as"]: data for data in launches}
    assert by_name["alice"]["run_as_uid"] == 20001
    assert by_name["alice"]["run_as_gid"] == 20001
    assert by_name["alice"]["run_as_gids"] == [5000, 5001]
    # No numbers: the node resolves the name, as before.
    assert by_name["bob"]["run_as_uid"] is None
    assert by_name["bob"]["run_as_gids"] == []


def test_a_resent_launch_carries_them_too(alice: User, cluster: list[Node]) -> None:
    Profile.objects.create(
        user=alice, unix_account="alice", unix_uid=20001, unix_gid=20002
    )
    attempt = start_job(JobFactory(owner=alice), cluster[0])
    frame = launch_frame(attempt.job, attempt, list(cluster[0].gpus.all()[:1]))
    assert frame["v"] == 2
    assert (frame["data"]["run_as_uid"], frame["data"]["run_as_gid"]) == (20001, 20002)
