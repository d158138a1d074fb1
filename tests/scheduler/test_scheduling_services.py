"""Production side of the policy: preemption, reasons, predictions, time limits,
GPU model constraints, and the state the pass loads."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import time_machine
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents import protocol
from scheduler import policy, services
from scheduler.models import Attempt, Job, JobEvent, UsageRecord, attach_queue_positions
from tests.conftest import hello_data, make_node
from tests.factories import JobFactory, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.capture import AgentFrames


def running(job: Job, node: Node, at: float) -> Attempt:
    attempt = start_job(job, node)
    assert services.mark_started(node.pk, started_data(attempt, at))
    return attempt


def exited(attempt: Attempt, at: float, code: int, reason: str = "killed") -> Any:
    return protocol.JobExitedData(
        attempt_id=attempt.pk,
        job_id=attempt.job_id,
        exit_code=code,
        ended_at=at,
        reason=reason,  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------ preemption


def test_it_preempts_a_victim_and_requeues_it_with_its_age_kept(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    victim = JobFactory(owner=alice, priority_class="best-effort")
    submitted = victim.submitted_at
    attempt = running(victim, node, at=1_800_000_000.0)

    with django_capture_on_commit_callbacks(execute=True):
        result = services.apply_decisions(
            [policy.Preempt(victim.pk, for_job_id=999, reason="high class waits")]
        )

    assert result.preempted == 1
    [(_, command)] = sent.calls()
    frame = protocol.parse_server_message(json.dumps(command))
    assert frame.type == "job.kill"
    assert frame.data.reason == "preempted"
    attempt.refresh_from_db()
    assert attempt.kill_reason == "preempted"

    services.finish_attempt(node.pk, exited(attempt, 1_800_000_100.0, 143))

    victim.refresh_from_db()
    assert victim.status == Job.Status.PENDING
    assert victim.submitted_at == submitted  # age kept
    assert victim.preemptions == 1
    assert victim.finished_at is None
    transitions = list(
        JobEvent.objects.filter(job=victim)
        .exclude(to_status="")
        .values_list("from_status", "to_status")
    )
    assert transitions[-2:] == [("running", "preempted"), ("preempted", "pending")]
    # Its GPU time until the stop is recorded as lost work (not checkpointable:
    # all of it), charged to nobody; its GPUs are free again.
    record = UsageRecord.objects.get(attempt=attempt)
    assert (record.gpu_seconds, record.lost_gpu_seconds) == (0, pytest.approx(100))


def test_it_does_not_preempt_a_job_already_being_stopped(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    victim = JobFactory(owner=alice, priority_class="best-effort")
    running(victim, cluster[0], at=1_800_000_000.0)
    services.apply_decisions([policy.Preempt(victim.pk, 1, "first")])

    result = services.apply_decisions([policy.Preempt(victim.pk, 2, "again")])

    assert result.preempted == 0


def test_a_victim_being_stopped_is_no_preemption_candidate(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    victim = JobFactory(owner=alice, priority_class="best-effort")
    running(victim, cluster[0], at=1_800_000_000.0)
    [before] = services.cluster_state().running
    services.apply_decisions([policy.Preempt(victim.pk, 1, "r")])

    [after] = services.cluster_state().running

    assert (before.preemptible, after.preemptible) == (True, False)


# ------------------------------------------------------------------ waiting jobs


def test_it_stores_reason_order_breakdown_and_planned_start(
    alice: User, cluster: list[Node]
) -> None:
    ahead = [JobFactory(owner=alice), JobFactory(owner=alice)]
    job = JobFactory(owner=alice)
    wait = policy.Wait(
        job.pk,
        policy.Reason.RESOURCES,
        "waiting for 4 GPUs",
        position=3,
        breakdown={"class": 500.0, "age": 12.3456, "fairshare": 800.0, "size": 1.0},
        est_start=1_800_000_000.0,
    )
    others = [
        policy.Wait(j.pk, policy.Reason.PRIORITY, "", n) for n, j in enumerate(ahead, 1)
    ]

    services.apply_decisions([*others, wait])

    job.refresh_from_db()
    assert job.pending_reason == "resources"
    assert job.queue_position == 3  # counted from the jobs ahead of it
    assert job.priority_breakdown["age"] == 12  # whole points: less churn
    assert job.priority == 1313
    assert job.est_start == datetime.fromtimestamp(1_800_000_000.0, tz=UTC)


def _waits(jobs: list[Job]) -> list[policy.Wait]:
    return [
        policy.Wait(j.pk, policy.Reason.RESOURCES, "waiting for 1 GPU", n)
        for n, j in enumerate(jobs, 1)
    ]


def _places(jobs: list[Job]) -> list[int | None]:
    fresh = list(Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("pk"))
    attach_queue_positions(fresh)
    by_pk = {j.pk: j.queue_position for j in fresh}
    return [by_pk[j.pk] for j in jobs]


def test_a_start_at_the_head_rewrites_no_waiting_row(
    alice: User, cluster: list[Node]
) -> None:
    jobs = [JobFactory(owner=alice) for _ in range(5)]
    assert services.apply_decisions(_waits(jobs)).updated_reasons == 5
    assert _places(jobs) == [1, 2, 3, 4, 5]

    start_job(jobs[0], cluster[0])  # the head starts: everyone moves up ...
    after = services.apply_decisions(_waits(jobs[1:]))

    assert after.updated_reasons == 0  # ... and no row is written for it
    assert _places(jobs) == [None, 1, 2, 3, 4]


def test_a_new_or_overtaking_job_is_the_only_row_written(
    alice: User, cluster: list[Node]
) -> None:
    jobs = [JobFactory(owner=alice) for _ in range(4)]
    services.apply_decisions(_waits(jobs))
    urgent = JobFactory(owner=alice)

    # the new job goes second; the last one overtakes two others
    order = [jobs[0], urgent, jobs[3], jobs[1], jobs[2]]
    got = services.apply_decisions(_waits(order))

    assert got.updated_reasons == 2
    assert _places(order) == [1, 2, 3, 4, 5]
    # the job page's "behind whom": the nearest first
    jobs[1].refresh_from_db()
    assert [j.pk for j in Job.objects.ahead_of(jobs[1])] == [
        jobs[3].pk, urgent.pk, jobs[0].pk
    ]  # fmt: skip


def test_a_held_job_leaves_the_count_and_no_place_is_shown_before_a_pass(
    alice: User, cluster: list[Node]
) -> None:
    jobs = [JobFactory(owner=alice) for _ in range(3)]
    services.apply_decisions(_waits(jobs))
    services.hold_job(jobs[0].pk, by=alice)
    new = JobFactory(owner=alice)

    assert _places([*jobs, new]) == [None, 1, 2, None]
    single = Job.objects.get(pk=jobs[2].pk)
    assert single.queue_position == 2  # one job: counted alone, the same place
    services.release_job(jobs[0].pk, by=alice)
    services.apply_decisions(_waits([jobs[0], jobs[1], jobs[2], new]))
    single.refresh_from_db()
    assert single.queue_position == 3  # counted again after a refresh


def test_the_job_page_says_why_and_behind_whom(
    alice: User, cluster: list[Node], client: Any
) -> None:
    first = JobFactory(owner=alice, name="first-in-line")
    mine = JobFactory(owner=alice, name="mine")
    services.apply_decisions(
        [
            policy.Wait(first.pk, policy.Reason.RESOURCES, "needs 4 GPUs", 1),
            policy.Wait(
                mine.pk,
                policy.Reason.PRIORITY,
                "behind higher-priority jobs",
                2,
                {"class": 500.0, "age": 20.0},
            ),
        ]
    )
    client.force_login(alice)

    page = client.get(f"/jobs/{mine.pk}/").content.decode()

    assert "behind higher-priority jobs" in page
    assert f"#{first.pk}</a>" in page
    assert "520 = class 500 + age 20" in page


# ------------------------------------------------------------------ predictions


def _completed(
    user: User,
    node: Node,
    workload: str,
    seconds: float,
    *,
    gpus: int = 1,
    limit: int = 3600,
    at: float = 1_800_000_000.0,
    code: int = 0,
) -> Job:
    job = JobFactory(owner=user, workload=workload, gpus=gpus, time_limit_s=limit)
    attempt = running(job, node, at=at)
    services.finish_attempt(node.pk, exited(attempt, at + seconds, code, "exited"))
    return job


def test_it_predicts_run_time_from_the_same_workload_then_any(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    node = cluster[0]
    for seconds in (100, 200, 300):
        _completed(alice, node, "resnet", seconds)
    _completed(alice, node, "bert", 5000)

    # the longest of the pool (scheduler.policy.predict)
    assert services.predict_runtime(alice.pk, "resnet", 1, 3600) == 300
    assert services.predict_runtime(alice.pk, "unknown-label", 1, 3600) == 5000
    assert services.predict_runtime(alice.pk + 1000, "resnet", 1, 3600) is None


def test_pools_predict_from_the_most_specific_pool_of_anyones_runs(
    alice: User, bob: User, cluster: list[Node], sent: AgentFrames, settings: Any
) -> None:
    """``GPULAB_PREDICTION=pools``: the median of the most specific pool that
    holds enough runs, read in one query of each pool's last runs
    (``policy.predict.POOLS``)."""
    settings.GPULAB_POLICY = {**settings.GPULAB_POLICY, "prediction": "pools"}
    node = cluster[0]
    at = 1_800_000_000.0
    # bob's resnet runs on 2 GPUs with a 2 h limit: 12 of them, the first two
    # long (older than the last ten each pool keeps)
    for i, seconds in enumerate([6000, 6000, *[600] * 5, *[900] * 5]):
        _completed(bob, node, "resnet", seconds, gpus=2, limit=7200, at=at + i * 1e4)
    # alice's own: two short ones of that request (under the pool's minimum of
    # three), and a long bert job with another limit
    for i in range(2):
        _completed(alice, node, "resnet", 60, gpus=2, limit=7200, at=at + 2e5 + i)
    _completed(alice, node, "bert", 40_000, limit=86_400, at=at + 3e5)
    # a run that failed is not history
    _completed(bob, node, "resnet", 10, gpus=2, limit=7200, at=at + 4e5, code=1)

    # label x GPUs x limit: bob's last ten (the two 6000 s runs dropped out) and
    # alice's two: 60, 60, 600 x 5, 900 x 5 -> the median is 750
    assert services.predict_runtime(alice.pk, "resnet", 2, 7200) == 750
    # one more of her own: her pool holds three (median 60)
    _completed(alice, node, "resnet", 60, gpus=2, limit=7200, at=at + 5e5)
    assert services.predict_runtime(alice.pk, "resnet", 2, 7200) == 60
    # another label and GPU count, same limit: the limit's pool, the last ten of
    # everyone's 2 h runs (600 x 2, 900 x 5, 60 x 3)
    assert services.predict_runtime(alice.pk, "vit", 4, 7200) == 750
    # a limit nobody used: her runs of the label, then any of hers
    assert services.predict_runtime(alice.pk, "bert", 1, 3600) == 40_000
    assert services.predict_runtime(alice.pk, "gpt", 1, 3600) == 60
    assert services.predict_runtime(bob.pk + 1000, "gpt", 1, 3600) is None
    # the query: one, whatever the history
    with CaptureQueriesContext(connection) as queries:
        services.predict_runtime(alice.pk, "resnet", 2, 7200)
    assert len(queries) == 1


def test_backfill_plans_with_the_smaller_of_limit_and_prediction(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    _completed(alice, cluster[0], "resnet", 600)

    job = services.submit_job(
        alice,
        services.JobRequest(name="j", command="true", workload="resnet"),
    )
    [pending] = [p for p in services.cluster_state().pending if p.id == job.pk]

    assert job.predicted_runtime_s == 600
    assert pending.planned_s == 600
    assert pending.time_limit_s == job.time_limit_s


# ------------------------------------------------------------------ constraints


def test_a_gpu_model_constraint_must_exist_and_counts_only_that_model(
    alice: User, db: None
) -> None:
    make_node("a100s", 2)
    k80s, _ = services.create_node("k80s")
    services.record_hello(k80s.pk, hello_data(8, 12288, "Tesla K80", host="k80s"))

    with pytest.raises(ValidationError) as caught:
        services.submit_job(
            alice, services.JobRequest(name="j", command="x", gpu_model="H100")
        )
    assert "No GPU matches 'H100'" in caught.value.message_dict["gpu_model"][0]

    with pytest.raises(ValidationError) as caught:
        services.submit_job(
            alice,
            services.JobRequest(name="j", command="x", gpu_model="A100", gpus=4),
        )
    assert caught.value.message_dict["gpus"] == [
        "The cluster has 2 GPU(s) matching 'A100' in all."
    ]


def test_the_state_carries_models_topology_and_usage(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    _completed(alice, cluster[0], "w", 3600)

    state = services.cluster_state()

    assert {g.model for g in state.gpus} == {"NVIDIA A100-80GB"}
    assert state.usage.group_usage["vision"] > 3000  # decayed a little
    assert state.usage.group_shares == {"vision": 1.0, "nlp": 1.0}
    assert ("vision", "alice") in state.usage.user_usage


# ------------------------------------------------------------------ time limits


def test_the_portal_stops_a_job_its_agent_let_run_past_its_limit(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    node = cluster[0]
    job = JobFactory(owner=alice, time_limit_s=60, kill_grace_s=5)
    start = timezone.now()
    attempt = running(job, node, at=start.timestamp())

    with time_machine.travel(start + timedelta(seconds=60 + 5 + 60)):
        assert services.enforce_time_limits() == []
    with (
        time_machine.travel(start + timedelta(seconds=60 + 5 + 121)),
        django_capture_on_commit_callbacks(execute=True),
    ):
        assert services.enforce_time_limits() == [job.pk]
        assert services.enforce_time_limits() == []  # asked once only

    [(_, kill)] = sent.calls()
    assert kill["data"]["reason"] == "timeout"
    services.finish_attempt(
        node.pk, exited(attempt, start.timestamp() + 190, 143, reason="killed")
    )
    job.refresh_from_db()
    assert job.status == Job.Status.TIMEOUT


def test_a_victim_being_stopped_counts_as_stopping_for_the_policy(
    alice: User, cluster: list[Node], sent: AgentFrames
) -> None:
    victim = JobFactory(owner=alice, priority_class="best-effort")
    running(victim, cluster[0], at=1_800_000_000.0)
    services.apply_decisions([policy.Preempt(victim.pk, 1, "r")])

    [view] = services.cluster_state().running

    assert view.stopping is True


# ------------------------------------------------------------------ multi-node


@pytest.fixture
def spanning(
    alice: User,
    cluster: list[Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> tuple[Job, Attempt, Node, Node]:
    """A 6-GPU job started across node-a (4 GPUs, rank 0) and node-b (2, rank 1)."""
    a, b = cluster
    job = JobFactory(owner=alice, gpus=6)
    start = policy.Start(
        job.pk,
        (
            policy.Placement(a.pk, tuple(g.pk for g in a.gpus.order_by("index"))),
            policy.Placement(b.pk, tuple(g.pk for g in b.gpus.order_by("index"))),
        ),
    )
    with django_capture_on_commit_callbacks(execute=True):
        assert services.apply_decisions([start]).started == 1
    return job, Attempt.objects.get(job=job), a, b


def test_a_job_spanning_nodes_gets_one_launch_per_node_with_torchrun_ranks(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames
) -> None:
    _, attempt, a, b = spanning

    launches = {node: f["data"] for node, f in sent.calls()}

    assert attempt.node_id == a.pk
    assert attempt.ranks == [a.pk, b.pk]
    assert set(launches) == {a.pk, b.pk}
    assert launches[a.pk]["gpu_uuids"] == [g.uuid for g in a.gpus.order_by("index")]
    assert launches[b.pk]["gpu_uuids"] == [g.uuid for g in b.gpus.order_by("index")]
    env_a, env_b = launches[a.pk]["env"], launches[b.pk]["env"]
    assert (env_a["PET_NODE_RANK"], env_b["PET_NODE_RANK"]) == ("0", "1")
    assert env_a["PET_NNODES"] == env_b["PET_NNODES"] == "2"
    assert (env_a["PET_NPROC_PER_NODE"], env_b["PET_NPROC_PER_NODE"]) == ("4", "2")
    assert env_a["MASTER_ADDR"] == env_b["MASTER_ADDR"] == "node-a"
    assert env_a["MASTER_PORT"] == env_b["MASTER_PORT"]


def test_every_rank_may_report_and_the_job_ends_when_all_have(
    spanning: tuple[Job, Attempt, Node, Node], sent: AgentFrames
) -> None:
    job, attempt, a, b = spanning
    t0 = 1_800_000_000.0
    assert services.mark_started(b.pk, started_data(attempt, t0))

    assert services.finish_attempt(b.pk, exited(attempt, t0 + 50, 0, "exited"))
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING  # rank 0 still runs

    assert not services.finish_attempt(b.pk, exited(attempt, t0 + 50, 0, "exited"))
    assert services.finish_attempt(a.pk, exited(attempt, t0 + 60, 0, "exited"))

    job.refresh_from_db()
    assert job.status == Job.Status.COMPLETED
    assert job.finished_at.timestamp() == t0 + 60
    assert UsageRecord.objects.filter(attempt=attempt).count() == 6


def test_a_failed_rank_stops_the_others_and_fails_the_job_with_its_code(
    spanning: tuple[Job, Attempt, Node, Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    job, attempt, a, b = spanning
    t0 = 1_800_000_000.0
    services.mark_started(a.pk, started_data(attempt, t0))
    sent.clear()

    with django_capture_on_commit_callbacks(execute=True):
        services.finish_attempt(a.pk, exited(attempt, t0 + 10, 3, "exited"))

    [(node_id, kill)] = sent.calls()
    assert node_id == b.pk
    assert kill["data"]["reason"] == "peer_failed"
    services.finish_attempt(b.pk, exited(attempt, t0 + 12, 143, "killed"))
    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert job.exit_code == 3
    assert "the others were stopped" in job.end_reason


def test_a_node_that_is_not_a_rank_cannot_report_for_the_job(
    spanning: tuple[Job, Attempt, Node, Node], db: None
) -> None:
    _, attempt, _, _ = spanning
    stranger = make_node("stranger", 1)[0]

    assert not services.mark_started(stranger.pk, started_data(attempt, 1.0))


def test_cancelling_a_spanning_job_stops_every_rank(
    spanning: tuple[Job, Attempt, Node, Node],
    alice: User,
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
) -> None:
    job, attempt, a, b = spanning
    services.mark_started(a.pk, started_data(attempt, 1_800_000_000.0))
    sent.clear()

    with django_capture_on_commit_callbacks(execute=True):
        services.cancel_job(job.pk, by=alice)

    assert {node for node, _ in sent.calls()} == {a.pk, b.pk}


def test_losing_one_node_of_a_spanning_job_requeues_it_and_stops_the_other_rank(
    spanning: tuple[Job, Attempt, Node, Node],
    sent: AgentFrames,
    django_capture_on_commit_callbacks: Any,
    settings: Any,
) -> None:
    job, attempt, a, b = spanning
    services.mark_started(a.pk, started_data(attempt, 1_800_000_000.0))
    stale = timezone.now() - timedelta(seconds=settings.GPULAB_NODE_LOST_AFTER + 5)
    type(b).objects.filter(pk=b.pk).update(last_seen_at=stale)
    sent.clear()

    with django_capture_on_commit_callbacks(execute=True):
        assert services.mark_lost_nodes() == [b.pk]

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.status == Job.Status.PENDING
    assert attempt.ended_at is not None
    [(node_id, kill)] = sent.calls()
    assert (node_id, kill["data"]["reason"]) == (a.pk, "node_lost")


def test_a_reconnecting_rank_node_gets_its_own_launch_again(
    spanning: tuple[Job, Attempt, Node, Node],
) -> None:
    _, attempt, a, b = spanning
    services.mark_started(a.pk, started_data(attempt, 1_800_000_000.0))
    hello = hello_data(2, host="node-b")
    hello = hello.model_copy(
        update={
            "gpus": [
                g.model_copy(update={"uuid": gpu.uuid})
                for g, gpu in zip(hello.gpus, b.gpus.order_by("index"), strict=True)
            ]
        }
    )

    result = services.record_hello(b.pk, hello)

    [launch] = [c for c in result.commands if c["type"] == "job.launch"]
    assert launch["data"]["gpu_uuids"] == [g.uuid for g in b.gpus.order_by("index")]
    assert launch["data"]["env"]["PET_NODE_RANK"] == "1"


def test_the_job_page_lists_a_spanning_jobs_gpus_in_rank_order(
    spanning: tuple[Job, Attempt, Node, Node], alice: User, client: Any
) -> None:
    job, _, _, _ = spanning
    client.force_login(alice)

    page = client.get(f"/jobs/{job.pk}/").content.decode()

    chips = [
        page.index(f"{n}:{i} NVIDIA")
        for n, i in [("node-a", 0), ("node-a", 3), ("node-b", 0), ("node-b", 1)]
    ]
    assert chips == sorted(chips)
