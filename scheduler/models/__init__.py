"""The scheduler's data, one module per domain; every public name is re-exported
here, so ``from scheduler.models import Job`` is the way to import a model.

- ``accounts``: lab groups, memberships, a user's portal settings (``Profile``);
- ``nodes``: nodes and their GPUs, node tokens, what each agent last reported;
- ``jobs``: jobs, job arrays, dependencies, the queue's order, a job's events;
- ``attempts``: a job's starts on nodes, the GPU slots they hold, their progress
  history and output;
- ``usage``: the charging ledger (``UsageRecord``);
- ``telemetry``: persisted GPU samples and their rollups;
- ``interference``: what co-location learned about pairs of workloads.

Only ``scheduler.services`` writes ``Job.status``, ``Attempt`` and ``Allocation`` rows;
PostgreSQL constraints back the rules that must hold under concurrency (one job per GPU
slot, one live attempt per job, unique GPU per node index).
"""

from scheduler.models.accounts import Group, Membership, Profile
from scheduler.models.attempts import Allocation, Attempt, JobLogChunk, ProgressSample
from scheduler.models.interference import InterferencePair
from scheduler.models.jobs import (
    QUEUE_ORDER,
    Job,
    JobArray,
    JobDependency,
    JobEvent,
    JobQuerySet,
    attach_queue_positions,
    may_cancel,
    queue_places,
    restarts_of,
)
from scheduler.models.nodes import (
    NODE_MODE_VERBS,
    AgentReport,
    AgentSighting,
    Gpu,
    Node,
    NodeModeVerb,
    NodeQuerySet,
    PortalHearing,
    hash_token,
    mode_flags,
    node_mode,
)
from scheduler.models.telemetry import GpuRollup, GpuSample
from scheduler.models.usage import UsageRecord

__all__ = [
    "NODE_MODE_VERBS",
    "QUEUE_ORDER",
    "AgentReport",
    "AgentSighting",
    "Allocation",
    "Attempt",
    "Gpu",
    "GpuRollup",
    "GpuSample",
    "Group",
    "InterferencePair",
    "Job",
    "JobArray",
    "JobDependency",
    "JobEvent",
    "JobLogChunk",
    "JobQuerySet",
    "Membership",
    "Node",
    "NodeModeVerb",
    "NodeQuerySet",
    "PortalHearing",
    "Profile",
    "ProgressSample",
    "UsageRecord",
    "attach_queue_positions",
    "hash_token",
    "may_cancel",
    "mode_flags",
    "node_mode",
    "queue_places",
    "restarts_of",
]
