"""The cluster message as a delta: what changed between two cluster states, and
which nodes' status, mode or holders changed (for ``node.state``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.events import ClusterDeltaEvent, ClusterState, GpuLive, NodeLive


def _structure(gpu: GpuLive) -> tuple[Any, ...]:
    """What a node page redraws its grid for (not the readings)."""
    return (
        gpu["state"],
        gpu["reason"],
        tuple((j["id"], j["name"], j["owner"]) for j in gpu["jobs"]),
        tuple(f["pid"] for f in gpu["foreign"]),
    )


def _without_at(gpu: GpuLive) -> dict[str, Any]:
    return {k: v for k, v in gpu.items() if k != "at"}


def diff(old: ClusterState | None, new: ClusterState) -> ClusterDeltaEvent:
    """The delta from ``old`` to ``new`` (``old`` None: everything is new). A GPU
    whose only change is the time of its reading is left out."""
    old_nodes = {n["id"]: n for n in old["nodes"]} if old else {}
    old_gpus = old["gpus"] if old else {}
    new_nodes = {n["id"]: n for n in new["nodes"]}
    order = [n["id"] for n in new["nodes"]]
    old_order = [n["id"] for n in old["nodes"]] if old else None
    return {
        "type": "cluster.delta",
        "seq": new["seq"],
        "base": old["seq"] if old else 0,
        "at": new["at"],
        "nodes": [n for i, n in new_nodes.items() if old_nodes.get(i) != n],
        "gpus": [
            g
            for k, g in new["gpus"].items()
            if k not in old_gpus or _without_at(old_gpus[k]) != _without_at(g)
        ],
        "removed_nodes": [i for i in old_nodes if i not in new_nodes],
        "removed_gpus": [k for k in old_gpus if k not in new["gpus"]],
        "order": order if order != old_order else None,
        "headline": new["headline"]
        if not old or old["headline"] != new["headline"]
        else None,
    }


def is_empty(delta: ClusterDeltaEvent) -> bool:
    return not (
        delta["nodes"]
        or delta["gpus"]
        or delta["removed_nodes"]
        or delta["removed_gpus"]
        or delta["order"] is not None
        or delta["headline"] is not None
    )


def changed_nodes(old: ClusterState | None, new: ClusterState) -> list[NodeLive]:
    """Nodes whose status, mode or GPUs' holders changed (for ``node.state``)."""
    if old is None:
        return []
    before = {n["id"]: n for n in old["nodes"]}
    out = []
    for node in new["nodes"]:
        prev = before.get(node["id"])
        if prev is None:
            continue
        if prev != node or any(
            k not in old["gpus"]
            or _structure(old["gpus"][k]) != _structure(new["gpus"][k])
            for k in node["gpus"]
        ):
            out.append(node)
    return out
