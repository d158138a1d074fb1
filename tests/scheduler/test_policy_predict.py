"""The run-time prediction rules (``scheduler.policy.predict``): pure, one copy
for the pass and the simulator."""

from __future__ import annotations

import pytest

from scheduler.policy.predict import (
    HISTORY,
    POOLS,
    History,
    Request,
    planned_runtime,
    pool_keys,
    predict,
    predict_pools,
)

JOB = Request(user="alice", workload="resnet", gpus=2, limit_s=7200.0)


def fed(*runs: tuple[Request, float]) -> History:
    history = History()
    for req, run_s in runs:
        history.add(req, run_s)
    return history


def test_longest_is_the_longest_run_and_none_without_history() -> None:
    assert predict([100.0, 300.0, 200.0]) == 300.0
    assert predict([]) is None


def test_pools_go_from_most_to_least_specific() -> None:
    names = [name for name, _ in pool_keys(JOB)]
    assert names == [p.name for p in POOLS]
    assert names[0] == "user+label+gpus+limit"
    assert names[-1] == "user"
    # the limit is keyed as a float: 7200 and 7200.0 are one pool
    assert pool_keys(Request("alice", "resnet", 2, 7200)) == pool_keys(JOB)


def test_the_owners_own_pool_wins_once_it_holds_enough_runs() -> None:
    other = Request("bob", "resnet", 2, 7200.0)
    history = fed((other, 1000.0), (other, 1000.0), (other, 1000.0))
    history.add(JOB, 100.0)
    history.add(JOB, 300.0)
    # two runs of her own are fewer than the pool's minimum: everyone's label x
    # GPUs x limit pool (median of 1000, 1000, 1000, 100, 300)
    assert history.predict(JOB) == (1000.0, "label+gpus+limit")
    history.add(JOB, 200.0)
    # the median of her three, not the longest
    assert history.predict(JOB) == (200.0, "user+label+gpus+limit")


def test_the_limit_says_more_than_the_owners_other_labels() -> None:
    # alice ran "bert" jobs for hours; another owner's jobs with the same limit
    # ran minutes: the limit pool comes before the owner's label-less pools
    history = fed(
        (Request("alice", "bert", 1, 86400.0), 40000.0),
        (Request("carol", "vit", 4, 7200.0), 600.0),
    )
    assert history.predict(JOB) == (600.0, "limit")
    assert history.predict(Request("alice", "bert", 1, 3600.0)) == (
        40000.0,
        "user+label",
    )
    assert history.predict(Request("alice", "gpt", 8, 3600.0)) == (40000.0, "user")
    assert history.predict(Request("dave", "gpt", 8, 3600.0)) == (None, "default")


def test_a_pool_keeps_its_last_runs_only() -> None:
    history = History(HISTORY)
    for _ in range(HISTORY):
        history.add(JOB, 10_000.0)
    for _ in range(HISTORY // 2 + 1):
        history.add(JOB, 60.0)
    # a majority of the last ten are 60 s; the older ten thousands drop out
    assert history.predict(JOB) == (60.0, "user+label+gpus+limit")
    for _ in range(HISTORY):
        history.add(JOB, 60.0)
    runs = history.runs[pool_keys(JOB)[0]]
    assert list(runs) == [60.0] * HISTORY


def test_predict_pools_reads_a_plain_mapping() -> None:
    key = pool_keys(JOB)[3]  # limit
    assert key == ("limit", (7200.0,))
    assert predict_pools({key: [100.0, 400.0]}, JOB) == (250.0, "limit")


@pytest.mark.parametrize(
    ("limit", "predicted", "planned"),
    [(3600.0, None, 3600.0), (3600.0, 600.0, 600.0), (3600.0, 9000.0, 3600.0)],
)
def test_planned_runtime_is_the_smaller_of_limit_and_prediction(
    limit: float, predicted: float | None, planned: float
) -> None:
    assert planned_runtime(limit, predicted) == planned
