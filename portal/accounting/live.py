"""Running attempts charged by the charging rule, up to now.

A running attempt has no usage record until it ends; whoever counts it before
(the scheduling pass's fair share, the quotas' live usage, the Usage page, the
admin overview) asks this module, so it is counted as its records will say when
it ends (``charging.split`` over its GPUs' runs, by declared memory or equally:
``GPULAB_SHARED_CHARGE``), not by a rule of its own.

``load`` is one query whatever the number of running attempts: every GPU a running
attempt holds, with every run there since the earliest running attempt on it
started (an ended neighbour changed its share while they overlapped). Allocations
are found through ``scheduler_alloc_released_idx`` (gpu, released_at): an
allocation is released at its attempt's end, so a neighbour that ended before
``since`` is never read, whatever the GPU's history.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection

from portal.accounting import charging
from portal.accounting.services import RunRow, as_runs

if TYPE_CHECKING:
    from collections.abc import Iterator
    from datetime import date, datetime

# {scope}: an extra condition on the running attempts' job ``j0`` (a user's or a
# group's), or nothing. Their neighbours are loaded whoever they belong to.
_SQL = """
WITH held AS (
    SELECT a.gpu_id, min(t.started_at) AS since
    FROM scheduler_allocation a
    JOIN scheduler_attempt t ON t.id = a.attempt_id
    JOIN scheduler_job j0 ON j0.id = t.job_id
    WHERE a.released_at IS NULL AND t.ended_at IS NULL
      AND t.started_at IS NOT NULL AND t.started_at <= %(now)s {scope}
    GROUP BY a.gpu_id
), near AS MATERIALIZED (
    -- per GPU two index ranges on (gpu, released_at), not all its allocations;
    -- materialized so the attempts are then joined once, not once per GPU
    SELECT h.gpu_id, h.since, a.attempt_id
    FROM held h
    CROSS JOIN LATERAL (
        SELECT attempt_id FROM scheduler_allocation
        WHERE gpu_id = h.gpu_id AND released_at IS NULL
        UNION ALL
        SELECT attempt_id FROM scheduler_allocation
        WHERE gpu_id = h.gpu_id AND released_at > h.since
    ) a
)
SELECT DISTINCT n.gpu_id, t.id, date_part('epoch', t.started_at),
       date_part('epoch', t.ended_at), j.gpu_memory_mib, g.memory_total_mib,
       j.owner_id, j.group_id, j.id, date_part('epoch', t.lost_since)
FROM near n
JOIN scheduler_attempt t ON t.id = n.attempt_id
JOIN scheduler_job j ON j.id = t.job_id
JOIN scheduler_gpu g ON g.id = n.gpu_id
WHERE t.started_at IS NOT NULL AND t.started_at <= %(now)s
  AND (t.ended_at IS NULL OR t.ended_at > n.since)
"""


@dataclass(frozen=True)
class LiveRun:
    """A running attempt's charge on one GPU so far, by UTC day."""

    attempt_id: int
    job_id: int
    user_id: int
    group_id: int
    gpu_id: int
    start: float
    by_day: dict[date, float]

    @property
    def gpu_seconds(self) -> float:
        return sum(self.by_day.values())


@dataclass(frozen=True)
class LiveCharges:
    """The runs on the GPUs of running attempts, as of ``now`` (epoch seconds),
    and who each running attempt belongs to."""

    now: float
    mode: str
    runs_by_gpu: dict[int, list[RunRow]]
    # running attempt -> (job, user, group)
    running: dict[int, tuple[int, int, int]]

    def _runs(self, gpu_id: int) -> list[charging.Run]:
        return as_runs(self.runs_by_gpu[gpu_id], self.mode)

    def seconds(self, since: datetime | None = None) -> dict[int, float]:
        """GPU-seconds charged to each running attempt, over all its GPUs, from
        ``since`` (None: its start) to ``now``."""
        at = None if since is None else since.timestamp()
        out: dict[int, float] = defaultdict(float)
        for gpu_id in self.runs_by_gpu:
            for attempt_id, s in charging.charged(
                self._runs(gpu_id), self.now, at
            ).items():
                if attempt_id in self.running:
                    out[attempt_id] += s
        return dict(out)

    def per_gpu(self) -> Iterator[LiveRun]:
        """Each running attempt's charge on each of its GPUs, by UTC day."""
        for gpu_id, rows in self.runs_by_gpu.items():
            split = charging.split(self._runs(gpu_id), self.now)
            for r in rows:
                if r.end is None and r.attempt_id in self.running:
                    job, user, group = self.running[r.attempt_id]
                    yield LiveRun(
                        r.attempt_id,
                        job,
                        user,
                        group,
                        gpu_id,
                        r.start,
                        split.get(r.attempt_id, {}),
                    )


def load(
    now: datetime, *, user_id: int | None = None, group_id: int | None = None
) -> LiveCharges:
    """The running attempts (started by ``now``; of one user or one group when
    given) and the runs that share their GPUs. One query."""
    scope, params = "", dict[str, Any](now=now)
    if group_id is not None:
        scope, params["scope"] = "AND j0.group_id = %(scope)s", group_id
    elif user_id is not None:
        scope, params["scope"] = "AND j0.owner_id = %(scope)s", user_id
    with connection.cursor() as cursor:
        cursor.execute(_SQL.format(scope=scope), params)
        rows = [RunRow.from_row(r) for r in cursor.fetchall()]
    by_gpu: dict[int, list[RunRow]] = defaultdict(list)
    running: dict[int, tuple[int, int, int]] = {}
    for r in rows:
        by_gpu[r.gpu_id].append(r)
        if r.end is None and (
            (group_id is None or r.group_id == group_id)
            and (user_id is None or r.user_id == user_id)
        ):
            running[r.attempt_id] = (r.job_id, r.user_id, r.group_id)
    return LiveCharges(
        now.timestamp(), settings.GPULAB_SHARED_CHARGE, dict(by_gpu), running
    )


class Provider:
    """``scheduler.hooks.Usage``: the running usage the scheduling pass reads."""

    def running(self, now: datetime) -> LiveCharges:
        return load(now)
