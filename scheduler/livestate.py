"""What the dashboards show: the cluster's nodes and GPUs, who holds each GPU, and
the headline numbers, read from PostgreSQL in a fixed number of queries.

The server-rendered pages (cluster, nodes, a node) and the live aggregator
(``scheduler.live``) both draw from ``cluster_state``, so a page and the updates
that follow it show the same thing in the same shape (``events.GpuLive``, ...).
Read only; no locks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from django.db import connection

from scheduler.models import Allocation, Gpu, Node, node_mode

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scheduler.events import (
        ClusterState,
        ForeignLive,
        GpuLive,
        Headline,
        HolderLive,
        NodeLive,
    )

# A GPU whose latest reading is older than this is shown greyed out ("stale"):
# its agent is cut off, or its node is gone.
STALE_AFTER_S = 15.0

# Utilisation buckets that colour a GPU (upper bounds, percent).
LOAD_BOUNDS = (10, 40, 70, 90)

_HEADLINE_SQL = """
SELECT
  (SELECT count(*) FROM scheduler_job WHERE status = 'pending'),
  (SELECT min(submitted_at) FROM scheduler_job WHERE status = 'pending'),
  (SELECT count(*) FILTER (WHERE j.status = 'running')
     FROM scheduler_attempt t JOIN scheduler_job j ON j.id = t.job_id
    WHERE t.ended_at IS NULL),
  (SELECT count(*) FILTER (WHERE j.status = 'starting')
     FROM scheduler_attempt t JOIN scheduler_job j ON j.id = t.job_id
    WHERE t.ended_at IS NULL)
"""


def load_bucket(util: float | None) -> int:
    """-1 without a reading, else 0 (under 10 %) to 4 (90 % and more)."""
    if util is None:
        return -1
    for bucket, bound in enumerate(LOAD_BOUNDS):
        if util < bound:
            return bucket
    return len(LOAD_BOUNDS)


def gpu_key(node_id: int, index: int) -> str:
    return f"{node_id}:{index}"


def _int(value: Any) -> int | None:
    return None if value is None else round(float(value))


def _holders(node_id: int | None) -> dict[int, list[tuple[int, HolderLive]]]:
    """GPU id -> [(attempt id, holder)] of the live allocations, one query."""
    rows = Allocation.objects.filter(released_at__isnull=True)
    if node_id is not None:
        rows = rows.filter(gpu__node_id=node_id)
    found: dict[int, dict[int, tuple[int, HolderLive]]] = {}
    for gpu_id, attempt_id, job_id, name, owner, declared in rows.order_by(
        "attempt__job_id"
    ).values_list(
        "gpu_id",
        "attempt_id",
        "attempt__job_id",
        "attempt__job__name",
        "attempt__job__owner__username",
        "attempt__job__gpu_memory_mib",
    ):
        # An exclusive job holds every slot of its GPUs: one entry per attempt.
        found.setdefault(gpu_id, {})[attempt_id] = (
            attempt_id,
            {
                "id": job_id,
                "name": name,
                "owner": owner,
                "declared_mib": declared,
                "used_mib": None,
            },
        )
    return {gpu: list(by_attempt.values()) for gpu, by_attempt in found.items()}


def _gpu_live(
    row: Mapping[str, Any],
    node: Mapping[str, Any],
    holders: list[tuple[int, HolderLive]],
    now: float,
    reading: tuple[float, dict[str, Any]] | None = None,
) -> GpuLive:
    latest = row["latest"] or {}
    at = row["latest_at"].timestamp() if row["latest_at"] else None
    if reading is not None and (at is None or reading[0] > at):
        at, latest = reading
    used: dict[int, int] = {}
    foreign: list[ForeignLive] = []
    for proc in latest.get("processes") or ():
        attempt, mib = proc.get("attempt_id"), proc.get("used_memory_mib")
        if attempt is None:
            foreign.append({"pid": int(proc.get("pid") or 0), "mib": _int(mib)})
        elif mib is not None:
            used[int(attempt)] = used.get(int(attempt), 0) + int(mib)
    jobs: list[HolderLive] = []
    for attempt_id, holder in holders:
        jobs.append({**holder, "used_mib": used.get(attempt_id)})
    mode = node_mode(draining=node["draining"], maintenance=node["maintenance"])
    reason = ""
    if not row["present"] or latest.get("lost"):
        reason = "GPU lost"
    elif row["mig_enabled"]:
        reason = "MIG mode (not supported yet)"
    elif node["status"] != Node.Status.UP:
        reason = f"node {Node.Status(node['status']).label}"
    elif not jobs and mode:
        reason = "node in maintenance" if mode == "maintenance" else "node draining"
    state: Any
    if reason and not jobs:
        state = "unavailable"
    elif len(jobs) > 1:
        state = "shared"
    elif jobs:
        state = "busy"
    else:
        state = "free"
    util = _int(latest.get("util_gpu"))
    return {
        "key": gpu_key(node["id"], row["index"]),
        "node": node["id"],
        "index": row["index"],
        "model": row["name"],
        "mem_total": row["memory_total_mib"],
        "util": util,
        "mem": _int(latest.get("memory_used_mib")),
        "temp": _int(latest.get("temperature_c")),
        "power": _int(latest.get("power_w")),
        "at": at,
        "stale": at is None or now - at > STALE_AFTER_S or not node["connected"],
        "state": state,
        "reason": reason,
        "load": load_bucket(util),
        "jobs": jobs,
        "foreign": foreign,
    }


def _headline(nodes: list[NodeLive], gpus: dict[str, GpuLive]) -> Headline:
    with connection.cursor() as cursor:
        cursor.execute(_HEADLINE_SQL)
        pending, oldest, running, starting = cursor.fetchone()
    states = [g["state"] for g in gpus.values()]
    busy = sum(s in ("busy", "shared") for s in states)
    free = states.count("free")
    return {
        "gpus": len(states),
        "busy": busy,
        "shared": states.count("shared"),
        "free": free,
        "unavailable": len(states) - busy - free,
        "running": running,
        "starting": starting,
        "pending": pending,
        "nodes": len(nodes),
        "nodes_up": sum(n["status"] == Node.Status.UP for n in nodes),
        "oldest_pending_at": oldest.timestamp() if oldest else None,
    }


def cluster_state(
    node_id: int | None = None,
    *,
    headline: bool = True,
    now: float | None = None,
    readings: dict[int, dict[str, Any]] | None = None,
) -> ClusterState:
    """Every node (or one) with its GPUs and their holders; the headline numbers
    unless ``headline`` is False. Four queries (three without the headline),
    whatever the cluster's size or history: nodes, GPUs with their latest
    readings, live allocations with their jobs, and the headline counts.
    ``readings`` (node id -> ``{"at", "gpus": {index: sample}}``, the live
    path's) replace a GPU's stored reading where they are newer."""
    readings = readings or {}
    now = time.time() if now is None else now
    node_rows = Node.objects.order_by("name")
    gpu_rows = Gpu.objects.order_by("node_id", "index")
    if node_id is not None:
        node_rows = node_rows.filter(pk=node_id)
        gpu_rows = gpu_rows.filter(node_id=node_id)
    nodes_by_id = {
        n["id"]: n
        for n in node_rows.values(
            "id", "name", "status", "draining", "maintenance", "connected"
        )
    }
    holders = _holders(node_id)
    gpus: dict[str, GpuLive] = {}
    keys: dict[int, list[str]] = {n: [] for n in nodes_by_id}
    for row in gpu_rows.values(
        "id",
        "node_id",
        "index",
        "name",
        "memory_total_mib",
        "present",
        "mig_enabled",
        "latest",
        "latest_at",
    ):
        node = nodes_by_id.get(row["node_id"])
        if node is None:  # a node made between the two reads
            continue
        fresh = readings.get(row["node_id"])
        sample = (fresh or {}).get("gpus", {}).get(str(row["index"]))
        reading = (float(fresh["at"]), sample) if fresh and sample else None
        gpu = _gpu_live(row, node, holders.get(row["id"], []), now, reading)
        gpus[gpu["key"]] = gpu
        keys[node["id"]].append(gpu["key"])
    nodes: list[NodeLive] = [
        {
            "id": n["id"],
            "name": n["name"],
            "status": n["status"],
            "status_label": Node.Status(n["status"]).label,
            "mode": node_mode(draining=n["draining"], maintenance=n["maintenance"]),
            "connected": n["connected"],
            "gpus": keys[n["id"]],
        }
        for n in nodes_by_id.values()
    ]
    empty: Headline = {
        "gpus": 0,
        "busy": 0,
        "shared": 0,
        "free": 0,
        "unavailable": 0,
        "running": 0,
        "starting": 0,
        "pending": 0,
        "nodes": 0,
        "nodes_up": 0,
        "oldest_pending_at": None,
    }
    return {
        "seq": 0,
        "at": now,
        "nodes": nodes,
        "gpus": gpus,
        "headline": _headline(nodes, gpus) if headline else empty,
    }


def grid(state: ClusterState) -> list[tuple[NodeLive, list[GpuLive]]]:
    """The state as the templates walk it: each node with its GPUs."""
    return [(n, [state["gpus"][k] for k in n["gpus"]]) for n in state["nodes"]]
