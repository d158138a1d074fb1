"""Channels group names and the helpers that send to them.

Group names are built only here. ``agent.<node_id>``: commands for one node's agent;
``cluster`` / ``node.<id>`` / ``job.<id>``: browser dashboards.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from collections.abc import Callable

    from agents import protocol

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"


def agent_group(node_id: int) -> str:
    return f"agent.{node_id}"


def node_group(node_id: int) -> str:
    return f"node.{node_id}"


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


class AgentCommandEvent(TypedDict):
    type: Literal["agent.command"]
    frame: dict[str, Any]


class AgentRevokedEvent(TypedDict):
    type: Literal["agent.revoked"]
    token_hash: str  # the node's new token's: a connection made with another ends


class JobStatusEvent(TypedDict):
    type: Literal["job.status"]
    job_id: int
    status: str
    message: str


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
