"""The verbs of the scheduler: the only code that writes job state and allocations.

Each service validates, writes inside one ``transaction.atomic()`` with the job row
locked (``select_for_update``), records a ``JobEvent``, and only after commit enqueues
tasks or sends websocket messages (``transaction.on_commit``). Views, tasks, consumers
and management commands are adapters around these functions: they call
``services.<verb>`` and never a submodule, so a verb can move between modules.

- ``jobs``: validation of a request, run-time prediction, submit, cancel;
- ``dependencies`` and ``arrays``: a submission's dependencies (parsed and
  checked) and job arrays (submit, cancel every task);
- ``snapshot`` and ``decisions``: the two ends of a scheduling pass, the state
  it reads (``snapshot``, ``cluster_state``) and what it writes
  (``apply_decisions``: starts, preemptions, evictions, quota stops, waits);
- ``lifecycle``: the only writer of a job's state (``transition``, checked
  against ``scheduler.lifecycle``'s table; ``start_many`` for a pass's starts)
  and of an attempt's end;
- ``starts``: the starts of a pass (batched) and the ``job.launch`` frames;
- what agents report, by concept: ``presence`` (authentication, hello,
  heartbeats, disconnection; ``set_node_status``, the only writer of a node's
  state), ``attempts`` (starts and exits), ``telemetry`` (GPU metrics, job
  progress), ``logs`` (output chunks, and the stored output read back),
  ``late_reports`` (a start or exit reported after the portal ended the attempt
  without the agent: its times and charges corrected);
- ``liveness``: lost nodes, time limits and lost launches (beat);
- ``reconcile``: what agents say they hold against the database, drift repaired
  (beat);
- ``nodes``: admin verbs on nodes (register, rotate the token) and GPUs (their slots);
- ``console``: the admin console's verbs: hold / release, requeue, priority
  class, a waiting job's request, node drain / maintenance / resume;
- ``interference``: co-location measured in production (rates, sharing
  episodes, observations) and what was learned about pairs;
- ``common``: events, after-commit passes, kill frames and errors the others
  share.
"""

from __future__ import annotations

from scheduler.services.arrays import (
    MAX_ARRAY_INDEX,
    cancel_array,
    parse_array_spec,
    submit_array,
)
from scheduler.services.attempts import finish_attempt, mark_started
from scheduler.services.common import FrameRefused, JobStateError, kill_frame
from scheduler.services.console import (
    REQUEST_FIELDS,
    NodeMode,
    change_job_request,
    hold_job,
    release_job,
    requeue_job,
    set_node_mode,
    set_priority_class,
    validate_request_change,
)
from scheduler.services.decisions import WAIT_FIELDS, ApplyResult, apply_decisions
from scheduler.services.dependencies import (
    format_dependencies,
    parse_dependencies,
    resolve_dependencies,
)
from scheduler.services.interference import mark_harmful, reset_interference_pairs
from scheduler.services.jobs import (
    ALLOWED_GPULAB_ENV,
    CHECKPOINT_SIGNALS,
    MAX_KILL_GRACE_S,
    PREDICTION_HISTORY,
    RESERVED_ENV,
    RESERVED_ENV_PREFIX,
    JobRequest,
    _charge_group,
    cancel_job,
    cluster_capacity,
    gpu_models,
    groups_of,
    interactive_request,
    predict_runtime,
    submit_job,
    validate_job_request,
    validated_submission,
)
from scheduler.services.lifecycle import transition
from scheduler.services.liveness import (
    TIME_LIMIT_MARGIN,
    enforce_time_limits,
    mark_lost_nodes,
    resend_kills,
    resend_launches,
)
from scheduler.services.logs import append_log, log_tail
from scheduler.services.nodes import (
    check_gpu_slots,
    check_node_name,
    create_node,
    rotate_node_token,
    set_gpu_slots,
)
from scheduler.services.presence import (
    HelloResult,
    authenticate_node,
    record_disconnect,
    record_heartbeat,
    record_hello,
    record_report,
    set_node_status,
)
from scheduler.services.reconcile import reconcile
from scheduler.services.snapshot import (
    Snapshot,
    StoredWait,
    class_specs,
    cluster_state,
    decayed_usage,
    load_knowledge,
    policy_config,
    snapshot,
)
from scheduler.services.starts import (
    MASTER_PORT_BASE,
    launch_frame,
    rank_env,
    start_jobs,
    unix_account_of,
)
from scheduler.services.telemetry import (
    MetricsFrame,
    record_metrics,
    record_metrics_many,
    record_progress,
)

__all__ = [
    "ALLOWED_GPULAB_ENV",
    "CHECKPOINT_SIGNALS",
    "MASTER_PORT_BASE",
    "MAX_ARRAY_INDEX",
    "MAX_KILL_GRACE_S",
    "PREDICTION_HISTORY",
    "REQUEST_FIELDS",
    "RESERVED_ENV",
    "RESERVED_ENV_PREFIX",
    "TIME_LIMIT_MARGIN",
    "WAIT_FIELDS",
    "ApplyResult",
    "FrameRefused",
    "HelloResult",
    "JobRequest",
    "JobStateError",
    "MetricsFrame",
    "NodeMode",
    "Snapshot",
    "StoredWait",
    "_charge_group",
    "append_log",
    "apply_decisions",
    "authenticate_node",
    "cancel_array",
    "cancel_job",
    "change_job_request",
    "check_gpu_slots",
    "check_node_name",
    "class_specs",
    "cluster_capacity",
    "cluster_state",
    "create_node",
    "decayed_usage",
    "enforce_time_limits",
    "finish_attempt",
    "format_dependencies",
    "gpu_models",
    "groups_of",
    "hold_job",
    "interactive_request",
    "kill_frame",
    "launch_frame",
    "load_knowledge",
    "log_tail",
    "mark_harmful",
    "mark_lost_nodes",
    "mark_started",
    "parse_array_spec",
    "parse_dependencies",
    "policy_config",
    "predict_runtime",
    "rank_env",
    "reconcile",
    "record_disconnect",
    "record_heartbeat",
    "record_hello",
    "record_metrics",
    "record_metrics_many",
    "record_progress",
    "record_report",
    "release_job",
    "requeue_job",
    "resend_kills",
    "resend_launches",
    "reset_interference_pairs",
    "resolve_dependencies",
    "rotate_node_token",
    "set_gpu_slots",
    "set_node_mode",
    "set_node_status",
    "set_priority_class",
    "snapshot",
    "start_jobs",
    "submit_array",
    "submit_job",
    "transition",
    "unix_account_of",
    "validate_job_request",
    "validate_request_change",
    "validated_submission",
]
