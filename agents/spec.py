"""The node and cluster spec grammar (DESIGN.md, "Spec grammar"), one parser everywhere.

- node: ``<gpus>x<MODEL>[:nvlink]``, e.g. ``4xA100-80GB``, ``8xH100-80GB:nvlink``
- cluster: ``<nodes>x<gpus>:<MODEL>[:nvlink]`` joined by ``+``, e.g. ``2x4:A100-80GB``,
  ``8x4:p100+4x8:k80``

GPU memory comes from a ``-<N>GB`` suffix of the model name, else from a table of
common models. Errors name the offending part of the spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Memory in GiB of GPU models named without a -NNGB suffix.
KNOWN_MODELS_GIB: dict[str, int] = {
    "k80": 12,
    "p100": 16,
    "v100": 16,
    "t4": 16,
    "a10": 24,
    "a30": 24,
    "a40": 48,
    "a100": 40,
    "h100": 80,
    "h200": 141,
    "l4": 24,
    "l40": 48,
    "l40s": 48,
    "rtx3090": 24,
    "rtx4090": 24,
    "gtx1080": 8,
    "gtx1080ti": 11,
}
MAX_GPUS_PER_NODE = 64
MAX_NODES = 100_000

_NODE_RE = re.compile(r"^(\d+)x([A-Za-z0-9][A-Za-z0-9_.-]*?)(:nvlink)?$")
_CLUSTER_RE = re.compile(r"^(\d+)x(\d+):([A-Za-z0-9][A-Za-z0-9_.-]*?)(:nvlink)?$")
_MEM_SUFFIX_RE = re.compile(r"-(\d+)GB$", re.IGNORECASE)


class SpecError(ValueError):
    """A spec string that does not follow the grammar; the message says why."""


@dataclass(frozen=True)
class NodeSpec:
    """One node: ``gpus`` GPUs of ``model``, all joined by NVLink when ``nvlink``."""

    gpus: int
    model: str
    memory_mib: int
    nvlink: bool = False

    def __str__(self) -> str:
        return f"{self.gpus}x{self.model}" + (":nvlink" if self.nvlink else "")


def model_memory_mib(model: str) -> int:
    """GPU memory in MiB for a model name (``A100-80GB`` -> 81920)."""
    match = _MEM_SUFFIX_RE.search(model)
    if match:
        gib = int(match.group(1))
        if gib < 1:
            raise SpecError(f"GPU model {model!r}: memory must be at least 1GB")
        return gib * 1024
    key = model.lower().replace("-", "").replace("_", "")
    if key in KNOWN_MODELS_GIB:
        return KNOWN_MODELS_GIB[key] * 1024
    raise SpecError(
        f"unknown GPU model {model!r}: name its memory with a suffix, e.g. {model}-16GB"
    )


def _check_count(what: str, value: int, maximum: int, part: str) -> None:
    if not 1 <= value <= maximum:
        raise SpecError(f"{part!r}: {what} must be between 1 and {maximum}")


def parse_node_spec(spec: str) -> NodeSpec:
    """Parse ``<gpus>x<MODEL>[:nvlink]``."""
    text = spec.strip()
    match = _NODE_RE.match(text)
    if not match:
        raise SpecError(
            f"node spec {spec!r} is not <gpus>x<MODEL>[:nvlink], e.g. 4xA100-80GB"
        )
    gpus = int(match.group(1))
    _check_count("the GPU count", gpus, MAX_GPUS_PER_NODE, text)
    model = match.group(2)
    return NodeSpec(gpus, model, model_memory_mib(model), bool(match.group(3)))


def parse_cluster_spec(spec: str) -> list[NodeSpec]:
    """Parse ``<nodes>x<gpus>:<MODEL>[:nvlink]`` parts joined by ``+``.

    Returns one ``NodeSpec`` per node.
    """
    if not spec.strip():
        raise SpecError("cluster spec is empty; expected e.g. 2x4:A100-80GB")
    nodes: list[NodeSpec] = []
    for raw_part in spec.split("+"):
        part = raw_part.strip()
        match = _CLUSTER_RE.match(part)
        if not match:
            raise SpecError(
                f"cluster spec part {part!r} is not <nodes>x<gpus>:<MODEL>[:nvlink],"
                " e.g. 2x4:A100-80GB"
            )
        count, gpus = int(match.group(1)), int(match.group(2))
        _check_count("the node count", count, MAX_NODES, part)
        _check_count("the GPU count", gpus, MAX_GPUS_PER_NODE, part)
        model = match.group(3)
        node = NodeSpec(gpus, model, model_memory_mib(model), bool(match.group(4)))
        nodes.extend([node] * count)
    if len(nodes) > MAX_NODES:
        raise SpecError(f"cluster spec {spec!r} has more than {MAX_NODES} nodes")
    return nodes
