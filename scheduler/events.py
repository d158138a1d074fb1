"""Channels group names, the typed payloads sent to them and the send helpers.

Group names are built only here. ``agent.<node_id>``: commands for one node's agent;
``cluster`` / ``node.<id>`` / ``job.<id>`` / ``queue``: browser dashboards
(``scheduler.live`` decides who sends what, and how often: docs/architecture.md,
"Live dashboards").
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from agents import protocol

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"
QUEUE_GROUP = "queue"


def agent_group(node_id: int) -> str:
    return f"agent.{node_id}"


def node_group(node_id: int) -> str:
    return f"node.{node_id}"


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


def terminal_group(terminal_id: str) -> str:
    """The viewers of one terminal of an interactive job (``portal.terminal``):
    its agent's ``terminal.output`` and ``terminal.exit`` go there."""
    return f"terminal.{terminal_id}"


def dashboard_group(kind: str, object_id: int | None = None) -> str | None:
    """The group a browser asks for (``{"subscribe": kind, "id": N}``), or None
    for a kind that takes no id given one, or the reverse, or an unknown kind."""
    if kind in (CLUSTER_GROUP, QUEUE_GROUP):
        return kind if object_id is None else None
    if object_id is None:
        return None
    if kind == "node":
        return node_group(object_id)
    if kind == "job":
        return job_group(object_id)
    return None


class AgentCommandEvent(TypedDict):
    type: Literal["agent.command"]
    frame: dict[str, Any]


class AgentTerminalEvent(TypedDict):
    """A ``terminal.*`` frame for a node's agent (``portal.terminal``): sent as
    it is, without the job-holder bookkeeping of ``agent.command``."""

    type: Literal["agent.terminal"]
    frame: dict[str, Any]


class TerminalOutputEvent(TypedDict):
    type: Literal["terminal.output"]
    data: str
    replay: bool
    n: int  # the agent's count of this terminal's output frames


class TerminalExitEvent(TypedDict):
    type: Literal["terminal.exit"]
    code: int | None
    message: str


class AgentRevokedEvent(TypedDict):
    type: Literal["agent.revoked"]
    token_hash: str  # the node's new token's: a connection made with another ends


class JobStatusEvent(TypedDict):
    type: Literal["job.status"]
    job_id: int
    status: str
    message: str


# ------------------------------------------------------------------ dashboards
# What browsers get, as sent to their groups (scheduler.live builds them; the
# DashboardConsumer forwards them as they are). ``GpuLive`` / ``NodeLive`` are also
# what the server-rendered pages are drawn from (scheduler.livestate), so a page and
# its live updates show the same thing.


class HolderLive(TypedDict):
    """A job holding a GPU: number, name, owner; declared and measured memory."""

    id: int
    name: str
    owner: str
    declared_mib: int | None
    used_mib: int | None


class ForeignLive(TypedDict):
    """A process on a GPU that no gpulab job owns."""

    pid: int
    mib: int | None


class GpuLive(TypedDict):
    """One GPU on the cluster page. ``state``: free, busy, shared (held by two
    jobs or more) or unavailable (``reason``: GPU lost, MIG, node lost ...);
    ``load``: the utilisation bucket that colours it (-1 unknown, 0 to 4)."""

    key: str
    node: int
    index: int
    model: str
    mem_total: int
    util: int | None
    mem: int | None
    temp: int | None
    power: int | None
    at: float | None
    stale: bool
    state: Literal["free", "busy", "shared", "unavailable"]
    reason: str
    load: int
    jobs: list[HolderLive]
    foreign: list[ForeignLive]


class NodeLive(TypedDict):
    """One node: ``status`` up / lost / new, ``mode`` "", draining or
    maintenance, and its GPUs' keys in index order."""

    id: int
    name: str
    status: str
    status_label: str
    mode: str
    connected: bool
    gpus: list[str]


class Headline(TypedDict):
    """The cluster page's headline numbers. ``oldest_pending_at``: when the job
    waiting longest was submitted (epoch seconds; browsers count the wait)."""

    gpus: int
    busy: int
    shared: int
    free: int
    unavailable: int
    running: int
    starting: int
    pending: int
    nodes: int
    nodes_up: int
    oldest_pending_at: float | None


class ClusterState(TypedDict):
    """The whole cluster as the dashboards show it; ``seq`` numbers the states
    the aggregator published (0: never published)."""

    seq: int
    at: float
    nodes: list[NodeLive]
    gpus: dict[str, GpuLive]
    headline: Headline


class ClusterDeltaEvent(TypedDict):
    """What changed from state ``base`` to state ``seq``: entries that are new or
    changed (whole entries, not field diffs), keys that went away, the headline
    when it changed. A browser whose state is not ``base`` asks for the whole
    state (``{"resync": "cluster"}``)."""

    type: Literal["cluster.delta"]
    seq: int
    base: int
    at: float
    nodes: list[NodeLive]
    gpus: list[GpuLive]
    removed_nodes: list[int]
    removed_gpus: list[str]
    order: list[int] | None
    headline: Headline | None


class ClusterStateEvent(TypedDict):
    """The whole state, to one browser (on subscribe and on resync)."""

    type: Literal["cluster.state"]
    state: ClusterState


class ProcLive(TypedDict):
    pid: int
    mib: int | None
    sm: float | None
    attempt: int | None
    job: int | None


class GpuSampleLive(TypedDict):
    """One GPU's reading in a node update (a chart point)."""

    index: int
    util: float | None
    mem: int | None
    mem_total: int | None
    temp: float | None
    power: float | None
    lost: bool
    procs: list[ProcLive]


class NodeMetricsEvent(TypedDict):
    """A node's latest sample: at most one a second per node."""

    type: Literal["node.metrics"]
    node: int
    at: float
    gpus: list[GpuSampleLive]


class NodeStateEvent(TypedDict):
    """A node's status, mode or holders changed (from the aggregator)."""

    type: Literal["node.state"]
    node: NodeLive
    gpus: list[GpuLive]


class JobGpuLive(TypedDict):
    """One GPU of a job in a job update: the GPU's reading, the memory the
    job's own processes hold on it, and the jobs on it (co-location)."""

    key: str
    node: int
    index: int
    util: float | None
    mem: int | None
    mem_total: int | None
    own_mib: int | None
    temp: float | None
    power: float | None
    jobs: list[int]


class JobMetricsEvent(TypedDict):
    """The job's GPUs on one node: at most one a second per node."""

    type: Literal["job.metrics"]
    job: int
    node: int
    at: float
    gpus: list[JobGpuLive]


class JobLogEvent(TypedDict):
    """A chunk of the job's output as stored (``offset`` in its rank's log)."""

    type: Literal["job.log"]
    job: int
    attempt: int
    node: int
    offset: int
    data: str


class JobProgressEvent(TypedDict):
    """The job's latest progress report as stored (``step`` of ``total``)."""

    type: Literal["job.progress"]
    job: int
    step: int
    total: int | None
    at: float


class QueueChangedEvent(TypedDict):
    """The queue changed (a pass reordered it, a job came, went or was held):
    pages showing it fetch it again. At most one a second."""

    type: Literal["queue.changed"]
    at: float


DashboardEvent = (
    JobStatusEvent
    | ClusterDeltaEvent
    | ClusterStateEvent
    | NodeMetricsEvent
    | NodeStateEvent
    | JobMetricsEvent
    | JobLogEvent
    | JobProgressEvent
    | QueueChangedEvent
)


def frame(model: Callable[..., protocol._Envelope], data: Any) -> dict[str, Any]:
    """A server -> agent frame as a JSON-ready dict (the consumer stamps ``seq``)."""
    envelope = model(seq=0, ts=time.time(), data=data)
    result: dict[str, Any] = envelope.model_dump(mode="json")
    return result


def _group_send(
    group: str, event: AgentCommandEvent | AgentRevokedEvent | JobStatusEvent
) -> None:
    """Send, or log why not: called after commit, where an exception would skip the
    other callbacks of the transaction and fail a request whose change is stored.
    With Redis down the message is lost; what must arrive has a backstop (a
    launch is re-sent by ``resend_launches`` and at hello; browsers re-read)."""
    layer = get_channel_layer()
    if layer is None:  # pragma: no cover - CHANNEL_LAYERS is always configured
        log.error("no channel layer configured; dropped %s", event["type"])
        return
    try:
        async_to_sync(layer.group_send)(group, dict(event))
    except (RedisError, OSError) as exc:
        log.error(
            "channel layer unavailable; %s to %s lost: %r", event["type"], group, exc
        )


def _group_send_many(
    sends: Sequence[tuple[str, AgentCommandEvent | JobStatusEvent]],
) -> None:
    """``_group_send`` of many messages in one trip to the event loop (one
    ``async_to_sync``, not one per message), each logged if lost as there."""
    layer = get_channel_layer()
    if layer is None:  # pragma: no cover - CHANNEL_LAYERS is always configured
        log.error("no channel layer configured; dropped %d messages", len(sends))
        return

    async def send_all() -> None:
        for group, event in sends:
            try:
                await layer.group_send(group, dict(event))
            except (RedisError, OSError) as exc:
                log.error(
                    "channel layer unavailable; %s to %s lost: %r",
                    event["type"],
                    group,
                    exc,
                )

    if sends:
        async_to_sync(send_all)()


def send_to_agents(commands: Sequence[tuple[int, dict[str, Any]]]) -> None:
    """``send_to_agent`` of many ``(node id, frame)`` at once (an array's kills)."""
    _group_send_many(
        [
            (agent_group(node_id), {"type": "agent.command", "frame": command})
            for node_id, command in commands
        ]
    )


def send_to_agent(node_id: int, command: dict[str, Any]) -> None:
    """Send one command frame to a node's agent (lost if it is not connected: the
    agent's next ``hello`` reconciles, see ``services.record_hello``)."""
    _group_send(agent_group(node_id), {"type": "agent.command", "frame": command})


def revoke_agent_token(node_id: int, token_hash: str) -> None:
    """The node's token was rotated: its agent's live connection, made with the old
    token, is closed (4401); one made with the new token stays."""
    _group_send(
        agent_group(node_id), {"type": "agent.revoked", "token_hash": token_hash}
    )


def broadcast_job_status(job_id: int, status: str, message: str) -> None:
    event: JobStatusEvent = {
        "type": "job.status",
        "job_id": job_id,
        "status": status,
        "message": message,
    }
    _group_send(job_group(job_id), event)


def broadcast_job_statuses(statuses: Sequence[tuple[int, str, str]]) -> None:
    """``broadcast_job_status`` of many ``(job id, status, message)`` at once."""
    _group_send_many(
        [
            (
                job_group(job_id),
                {
                    "type": "job.status",
                    "job_id": job_id,
                    "status": status,
                    "message": message,
                },
            )
            for job_id, status, message in statuses
        ]
    )
