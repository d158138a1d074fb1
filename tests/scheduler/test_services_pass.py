"""One scheduling pass (``pass_runner.run_one_pass``) as a whole: it runs with
Python's cycle collector paused and leaves the collector as it found it, and it
keeps its statistics (``scheduler.pass_log``) on the real Redis."""

from __future__ import annotations

import gc
import json
import logging
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest

from scheduler import pass_log, pass_requests, pass_runner, policy, services
from scheduler.policy import PassResult, PassStats
from tests.factories import JobFactory

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db


@pytest.fixture
def collector_seen() -> Iterator[list[bool]]:
    """Whether the cycle collector was enabled while the pass loaded its state."""
    seen: list[bool] = []
    real = services.snapshot

    def snapshot() -> services.Snapshot:
        seen.append(gc.isenabled())
        return real()

    with mock.patch.object(services, "snapshot", side_effect=snapshot):
        yield seen
    gc.enable()


def test_a_pass_pauses_the_cycle_collector_and_resumes_it(
    alice: User, cluster: list[Node], collector_seen: list[bool]
) -> None:
    JobFactory(owner=alice)
    assert gc.isenabled()

    result = pass_runner.run_one_pass()

    assert result["started"] == 1
    assert collector_seen == [False]
    assert gc.isenabled()


def test_a_pass_leaves_a_paused_collector_paused(
    cluster: list[Node], collector_seen: list[bool]
) -> None:
    gc.disable()

    pass_runner.run_one_pass()

    assert collector_seen == [False]
    assert not gc.isenabled()


def test_a_failing_pass_resumes_the_collector(cluster: list[Node]) -> None:
    with (
        mock.patch.object(services, "snapshot", side_effect=RuntimeError("db")),
        pytest.raises(RuntimeError),
    ):
        pass_runner.run_one_pass()

    assert gc.isenabled()


@pytest.fixture
def no_passes_kept() -> None:
    """This test's passes only: the run's earlier records and totals dropped."""
    client = pass_requests._redis_client()
    client.delete(pass_log._recent_key(), pass_log._totals_key())


@pytest.mark.usefixtures("no_passes_kept")
def test_a_pass_keeps_the_policys_statistics_and_its_own_times(
    alice: User, cluster: list[Node]
) -> None:
    JobFactory(owner=alice)
    stats = PassStats(
        considered=7,
        started=1,
        preempted=2,
        reserved=3,
        backfilled=4,
        stop_reason="backfill test budget",
        stage_s={"ordering": 0.25, "placement": 0.5},
    )
    real = policy.run_pass

    def run_pass(state: policy.ClusterState) -> PassResult:
        return PassResult(real(state).decisions, stats)

    with mock.patch.object(policy, "run_pass", side_effect=run_pass):
        result = pass_runner.run_one_pass()

    assert result["started"] == 1  # the real decisions were applied
    assert result["stop_reason"] == "backfill test budget"
    [kept] = pass_log.recent()
    assert (kept.considered, kept.started, kept.preempted) == (7, 1, 2)
    assert (kept.reserved, kept.backfilled) == (3, 4)
    assert kept.stop_reason == "backfill test budget"
    assert kept.stage_s == {"ordering": 0.25, "placement": 0.5}
    assert kept.load_s > 0 and kept.decide_s > 0 and kept.apply_s > 0
    assert kept.total_s == pytest.approx(kept.load_s + kept.decide_s + kept.apply_s)
    assert kept.total_s * 1000 == pytest.approx(result["ms"], abs=0.1)
    totals = pass_log.totals()
    assert totals.passes == 1
    assert totals.counts == {
        "considered": 7,
        "started": 1,
        "preempted": 2,
        "reserved": 3,
        "backfilled": 4,
    }
    assert totals.stops == {"backfill test budget": 1}
    assert totals.since == kept.at


def _record(
    at: float, total_s: float, stop: str = "queue exhausted"
) -> pass_log.PassRecord:
    return pass_log.PassRecord.of(
        PassStats(considered=1, started=1, stop_reason=stop),
        at=at,
        load_s=total_s / 4,
        decide_s=total_s / 2,
        apply_s=total_s / 4,
        total_s=total_s,
    )


@pytest.mark.usefixtures("no_passes_kept")
def test_the_kept_passes_are_capped_and_the_totals_count_them_all(
    settings: Any,
) -> None:
    settings.GPULAB_PASS_LOG_SIZE = 3
    for i, total_s in enumerate([0.1, 0.9, 0.3, 0.2, 0.4]):
        pass_log.keep(_record(1000.0 + i, total_s, "queue exhausted" if i else "cap"))

    assert [r.at for r in pass_log.recent()] == [1004.0, 1003.0, 1002.0]
    assert pass_requests._redis_client().llen(pass_log._recent_key()) == 3
    assert [r.at for r in pass_log.recent(2)] == [1004.0, 1003.0]
    totals = pass_log.totals()
    assert totals.passes == 5
    assert totals.counts["started"] == 5
    assert totals.max_s == 0.9
    assert totals.total_s == pytest.approx(1.9)
    assert totals.mean_s == pytest.approx(0.38)
    assert totals.stops == {"cap": 1, "queue exhausted": 4}
    assert totals.since == 1000.0


@pytest.mark.parametrize(
    ("total_s", "stop", "level"),
    [
        (0.5, "queue exhausted", logging.DEBUG),  # routine
        (1.5, "queue exhausted", logging.INFO),  # slower than the setting
        (0.5, "backfill test budget", logging.INFO),  # stopped early
    ],
)
@pytest.mark.usefixtures("no_passes_kept")
def test_a_pass_is_logged_at_info_only_when_slow_or_stopped_early(
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    total_s: float,
    stop: str,
    level: int,
) -> None:
    settings.GPULAB_PASS_SLOW_S = 1.0
    caplog.set_level(logging.DEBUG, logger="scheduler.pass_log")

    pass_log.keep(_record(1000.0, total_s, stop))

    [line] = [r for r in caplog.records if r.name == "scheduler.pass_log"]
    assert line.levelno == level
    assert f"stopped: {stop}" in line.getMessage()
    assert f"{total_s * 1000:.1f} ms" in line.getMessage()


@pytest.mark.usefixtures("no_passes_kept")
def test_a_record_of_another_version_is_read_or_left_out() -> None:
    newer = json.loads(_record(1001.0, 0.2).to_json()) | {"new_field": 1}
    older = {"at": 1000.0, "started": 1}  # fields missing
    client = pass_requests._redis_client()
    client.rpush(pass_log._recent_key(), json.dumps(newer), json.dumps(older))

    assert [(r.at, r.total_s) for r in pass_log.recent()] == [(1001.0, 0.2)]
