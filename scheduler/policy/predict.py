"""Run-time prediction from history: one rule for the Celery pass
(``services.predict_runtime``) and the simulator.

Two rules, chosen by ``PolicyConfig.prediction`` (``GPULAB_PREDICTION``):

- ``longest`` (``predict``): the longest of the last ``HISTORY`` completed runs of
  the same user and workload label, else of the same user (the caller picks the
  pool). A prediction that is too long only makes backfill more careful, one that
  is too short lets a job jump the queue and then delay the reservation it
  promised not to delay; against the median, the longest of the last ten halves
  the reservations that slip when backfill plans with predictions.
- ``pools`` (``predict_pools``): the median of the last ``HISTORY`` runs of the
  most specific pool of similar jobs that holds enough of them (``POOLS``: user x
  label x GPUs x time limit, then label x GPUs x limit across users, label x limit,
  limit, user x label, user). The time limit a user sets says more about the run
  than who the user is (on the benchmark traces the pools' order, by rank
  correlation with the true run time, is 0.70 against 0.56 on (b) and 0.44
  against 0.20 on (a): docs/policy.md, "Predictions by pools"), and a median is the
  central estimate the run-time factor orders by, where the longest is a bound.

Only what a job declares at submit time keys a pool (owner, workload label, GPUs,
time limit), and only runs that completed within their limit are history (a run
killed at its limit says only "at least the limit"). A running job that outlives
its prediction is planned to its limit from then on (``index.PassIndex.planned_end``).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

HISTORY = 10  # completed runs a prediction reads, the most recent ones
PREDICTIONS = ("longest", "pools")

# A pool's key: its name and the values of its fields, e.g.
# ("label+gpus+limit", ("ResNet-50", 4, 7200.0)).
PoolKey: TypeAlias = tuple[str, tuple[object, ...]]


@dataclass(frozen=True)
class Pool:
    """Similar past jobs: those with the same values of ``fields`` (of ``user``,
    ``workload``, ``gpus``, ``limit``); used once it holds ``min_runs`` runs."""

    name: str
    fields: tuple[str, ...]
    min_runs: int


POOLS = (
    Pool("user+label+gpus+limit", ("user", "workload", "gpus", "limit"), 3),
    Pool("label+gpus+limit", ("workload", "gpus", "limit"), 3),
    Pool("label+limit", ("workload", "limit"), 3),
    Pool("limit", ("limit",), 1),
    Pool("user+label", ("user", "workload"), 1),
    Pool("user", ("user",), 1),
)


@dataclass(frozen=True)
class Request:
    """What a job declares that keys its pools."""

    user: str
    workload: str
    gpus: int
    limit_s: float


def pool_keys(req: Request) -> tuple[PoolKey, ...]:
    """The keys of ``req``'s pools, most specific first (``POOLS``' order)."""
    values = {
        "user": req.user,
        "workload": req.workload,
        "gpus": req.gpus,
        "limit": float(req.limit_s),
    }
    return tuple((p.name, tuple(values[f] for f in p.fields)) for p in POOLS)


MIN_RUNS = {p.name: p.min_runs for p in POOLS}


def deciding_keys(req: Request, source: str) -> tuple[PoolKey, ...]:
    """The keys of the pools that decide ``req``'s prediction made from pool
    ``source`` (``predict_pools``' name; "default": none held enough runs): that
    pool and the more specific ones. Pools only gain runs, so only a run added
    to one of these can change the prediction; a run added to a less specific
    pool cannot."""
    keys = pool_keys(req)
    for i, pool in enumerate(POOLS):
        if pool.name == source:
            return keys[: i + 1]
    return keys


def predict(recent_runs_s: Iterable[float]) -> float | None:
    """``longest``: the prediction from the last ``HISTORY`` runs of the pool (the
    caller cuts it); None without history (the job then plans with its limit)."""
    return max(recent_runs_s, default=None)


def predict_pools(
    history: Mapping[PoolKey, Iterable[float]], req: Request
) -> tuple[float | None, str]:
    """``pools``: the median of the runs of ``req``'s most specific pool that
    holds its ``min_runs`` (``history``: each pool's last ``HISTORY`` runs), and
    that pool's name; (None, "default") when none does."""
    for key in pool_keys(req):
        runs = history.get(key)
        if runs is None:
            continue
        got = list(runs)
        if len(got) >= MIN_RUNS[key[0]]:
            return statistics.median(got), key[0]
    return None, "default"


class History:
    """Each pool's last ``n`` completed runs, fed one completed run at a time in
    the order they ended (the simulator keeps one; production builds one from
    its recent runs, most recent last)."""

    def __init__(self, n: int = HISTORY) -> None:
        self.n = n
        self.runs: dict[PoolKey, deque[float]] = {}

    def add(self, req: Request, run_s: float) -> tuple[PoolKey, ...]:
        """Adds a completed run to each of ``req``'s pools; returns their keys
        (only the predictions these pools decide can change)."""
        keys = pool_keys(req)
        for key in keys:
            got = self.runs.get(key)
            if got is None:
                got = self.runs[key] = deque(maxlen=self.n)
            got.append(run_s)
        return keys

    def predict(self, req: Request) -> tuple[float | None, str]:
        return predict_pools(self.runs, req)


def planned_runtime(limit_s: float, predicted_s: float | None) -> float:
    """How long a job is planned to run: min(limit, prediction), the limit when
    there is no prediction. What the run-time factor reads and what backfill plans
    with under ``backfill_plan = "prediction"``; one rule for the pass, the job
    page and the simulator."""
    return limit_s if predicted_s is None else min(limit_s, predicted_s)
