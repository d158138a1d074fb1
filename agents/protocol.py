"""The agent <-> server wire protocol: strict pydantic models shared by both sides.

Every frame is one JSON object ``{"type", "v", "seq", "ts", "data"}`` (DESIGN.md,
"Agent protocol"). ``seq`` increases per agent (persisted in its state directory) so
the server can de-duplicate replays; server-to-agent frames carry the server's own
counter. Unknown fields, unknown types and wrong types are rejected: the server
answers with an ``error`` frame and never crashes (``parse_agent_message``).

This module must not import Django: the agent is a standalone package.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

# 2: the launch carries the account's uid, gid and supplementary gids.
PROTOCOL_VERSION: Final = 2
# Largest frame either side accepts, in bytes.
MAX_FRAME_BYTES = 1 << 20
# The agent's websocket offers no compression (permessage-deflate): its frames are
# a couple of kB a second on a lab's network, and compressing them costs both ends
# CPU for every frame (the web process's deflate and inflate, bench/README.md).
WS_COMPRESSION: Final = None
# Largest job command a launch can carry, in characters (the portal's
# GPULAB_MAX_COMMAND_BYTES may not exceed it).
MAX_COMMAND_CHARS = 256 * 1024


class CloseCode(IntEnum):
    """Why the server closed an agent's websocket: 4000-4999 are the
    application's, the others RFC 6455's. The agent logs the code and reconnects
    with backoff whatever it is; ``TOKEN_REJECTED`` ones are logged as errors."""

    # A frame over MAX_FRAME_BYTES.
    TOO_BIG = 1009
    # The database is unreachable: the agent reconnects and replays what was not
    # acked.
    TRY_AGAIN = 1013
    # The hello's protocol version is not PROTOCOL_VERSION.
    BAD_VERSION = 4400
    # No token, an unknown one, or one rotated while connected.
    BAD_TOKEN = 4401
    # A newer connection of the same node replaced this one.
    REPLACED = 4409
    # The node was declared lost: reconnect and say hello (reconciliation).
    NODE_LOST = 4410


# The close codes that mean the server refused the agent's token.
TOKEN_REJECTED: Final = frozenset({CloseCode.BAD_TOKEN})

NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]
Text = Annotated[str, Field(max_length=4096)]
# A uid or gid (0 is accepted here so that the agent can refuse it by name).
UnixId = Annotated[int, Field(ge=0, le=2**32 - 2)]
# Most supplementary groups a launch may carry (Linux's NGROUPS_MAX is 65536).
MAX_GIDS = 1024


class _Model(BaseModel):
    # No NaN or infinity anywhere: JSON has neither, and PostgreSQL's jsonb (a
    # GPU's latest state) refuses them, so one would fail the frame's whole batch.
    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, allow_inf_nan=False
    )


# Seconds since the epoch, up to the last second of year 9999 (what a datetime
# holds).
Timestamp = Annotated[float, Field(ge=0, le=253_402_300_799)]


# ---------------------------------------------------------------- payloads (data)


class TopologyLink(_Model):
    """How GPU ``peer`` is reached from this GPU: NVML's common-ancestor level
    (``nvmlDeviceGetTopologyCommonAncestor``): 0 same board, 10 single PCIe switch,
    20 multiple switches, 30 host bridge, 40 same NUMA node, 50 across the system
    (SMP interconnect). Lower is closer; NVLink is reported in ``nvlink_peers``."""

    peer: NonNegInt
    level: Annotated[int, Field(ge=0, le=100)]


class GpuInfo(_Model):
    """Static facts about one GPU, sent in ``hello``."""

    index: NonNegInt
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    memory_total_mib: PosInt
    # Indexes of the GPUs joined to this one by NVLink.
    nvlink_peers: list[NonNegInt] = []
    topology: Annotated[list[TopologyLink], Field(max_length=64)] = []
    mig_enabled: bool = False


class RunningJob(_Model):
    """A job the agent is running (or has finished but the server has not acked)."""

    attempt_id: PosInt
    job_id: PosInt
    pid: NonNegInt | None = None


# Most attempts one hello or heartbeat may list.
MAX_HELD = 1024


class HelloData(_Model):
    agent_version: Text
    hostname: Text
    incarnation: Annotated[str, Field(min_length=1, max_length=64)]
    driver_version: Text | None = None
    cuda_version: Text | None = None
    gpus: Annotated[list[GpuInfo], Field(max_length=64)]
    # Every attempt the agent holds: running, or ended with its exit not yet acked.
    running: Annotated[list[RunningJob], Field(max_length=MAX_HELD)] = []


class HeartbeatData(_Model):
    # Attempt ids the agent holds (as in hello): the reconciler's evidence.
    running: Annotated[list[PosInt], Field(max_length=MAX_HELD)] = []


class ProcessSample(_Model):
    pid: NonNegInt
    used_memory_mib: NonNegInt | None = None
    sm_util: Annotated[float, Field(ge=0, le=100)] | None = None
    # The portal attempt that owns the process, None for a foreign process.
    attempt_id: PosInt | None = None


class GpuSample(_Model):
    """One reading of one GPU. A metric the GPU does not support is ``None``."""

    index: NonNegInt
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    util_gpu: Annotated[float, Field(ge=0, le=100)] | None = None
    util_mem: Annotated[float, Field(ge=0, le=100)] | None = None
    memory_used_mib: NonNegInt | None = None
    memory_total_mib: NonNegInt | None = None
    temperature_c: float | None = None
    power_w: Annotated[float, Field(ge=0)] | None = None
    power_limit_w: Annotated[float, Field(ge=0)] | None = None
    sm_clock_mhz: NonNegInt | None = None
    pcie_rx_kib_s: NonNegInt | None = None
    pcie_tx_kib_s: NonNegInt | None = None
    ecc_uncorrected: NonNegInt | None = None
    energy_mj: NonNegInt | None = None
    lost: bool = False
    processes: Annotated[list[ProcessSample], Field(max_length=256)] = []


class MetricsData(_Model):
    sampled_at: Timestamp
    gpus: Annotated[list[GpuSample], Field(max_length=64)]


# What an interactive job runs: "" a batch command, "jupyter" JupyterLab (the
# agent starts it, agents.jupyter), "shell" a job that holds its GPUs for terminals.
InteractiveKind = Literal["", "jupyter", "shell"]


class JobStartedData(_Model):
    attempt_id: PosInt
    job_id: PosInt
    pid: NonNegInt
    started_at: Timestamp
    # An interactive job's server on the node: the address and port it listens
    # on (where the portal's proxy forwards) and the command that ran.
    interactive_host: Text = ""
    interactive_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    interactive_command: Annotated[str, Field(max_length=1024)] = ""
    # The Unix account the job runs as: its run_as, the agent's --default-account,
    # or the agent's own account. Empty from an agent that does not say.
    run_as: Annotated[str, Field(max_length=256)] = ""


ExitReason = Literal[
    "exited",  # the command ended by itself (exit_code is its status, 128+N if signalled)
    "killed",  # stopped on the server's request (job.kill)
    "never_started",  # a kill arrived for an attempt the agent never launched
    "launch_failed",  # the agent could not start it (bad workdir, unknown user...)
    "lost",  # the agent found the job's shim gone without an exit code
    "timeout",  # stopped by the agent at the job's time limit
    # Not launched: rank 0 of a job spanning nodes found its rendezvous port
    # (MASTER_PORT) in use on its node; the portal relaunches the job.
    "port_busy",
]


class JobExitedData(_Model):
    attempt_id: PosInt
    job_id: PosInt
    exit_code: int | None
    ended_at: Timestamp
    reason: ExitReason = "exited"
    message: Text = ""


class JobLogData(_Model):
    attempt_id: PosInt
    job_id: PosInt
    offset: NonNegInt  # byte offset of this chunk in the job's log file
    data: Annotated[str, Field(max_length=256 * 1024)]


# Largest step or total a job may report: PostgreSQL's bigint.
ProgressCount = Annotated[int, Field(ge=0, le=2**63 - 1)]


class JobProgressData(_Model):
    """The latest progress a job reported in its output (a ``GPULAB_PROGRESS
    <step>[/<total>]`` line, ``agents.progress``); ``at`` is when the agent read
    that line (wall clock). At most one per job every 10 s, and a last one before
    its ``job.exited``."""

    attempt_id: PosInt
    job_id: PosInt
    at: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    step: ProgressCount
    total: ProgressCount | None = None


class JobLaunchData(_Model):
    attempt_id: PosInt
    attempt: PosInt  # attempt number of the job (1, 2, ...)
    job_id: PosInt
    name: Text
    command: Annotated[str, Field(min_length=1, max_length=MAX_COMMAND_CHARS)]
    workdir: Text
    env: dict[str, str] = {}
    gpu_uuids: list[str]
    grace_s: NonNegInt = 30
    time_limit_s: PosInt | None = None
    run_as: Text | None = None  # Unix account; None: the agent's own account
    # The account's numbers (from the lab's directory): an agent running as root
    # switches to them without asking the node's user database, as Slurm does with
    # the uid in its job credential. None: the node resolves ``run_as``.
    run_as_uid: UnixId | None = None
    run_as_gid: UnixId | None = None
    run_as_gids: Annotated[list[UnixId], Field(max_length=MAX_GIDS)] = []
    # An interactive job: the agent runs its own server in place of ``command``
    # ("jupyter": JupyterLab under ``interactive_base_url`` with the token the
    # portal's proxy presents; the token never reaches a browser).
    interactive: InteractiveKind = ""
    interactive_token: Annotated[str, Field(max_length=64)] = ""
    interactive_base_url: Annotated[str, Field(max_length=256)] = ""

    @model_validator(mode="after")
    def _uid_with_gid(self) -> JobLaunchData:
        if (self.run_as_uid is None) != (self.run_as_gid is None):
            raise ValueError("run_as_uid and run_as_gid come together")
        if self.run_as_gids and self.run_as_uid is None:
            raise ValueError("run_as_gids needs run_as_uid")
        return self


KillReason = Literal[
    "cancelled",
    "timeout",
    "preempted",
    "stale",
    "node_lost",
    "peer_failed",  # another rank of a multi-node job failed
    "evicted",  # sharing ended to keep a slowdown cap: back to the queue
    "memory_overrun",  # used more GPU memory than declared on a shared GPU
    "quota",  # a hard quota of it is used up (GPULAB_QUOTA_OVERRUN=stop)
    "requeued",  # an admin sent it back to the queue (its age kept)
]


# Signals a kill may start with (a checkpointable job's checkpoint signal);
# SIGKILL follows after ``grace_s``.
KillSignal = Literal["TERM", "INT", "USR1", "USR2"]


class JobKillData(_Model):
    attempt_id: PosInt
    job_id: PosInt
    reason: KillReason
    grace_s: NonNegInt = 30
    signal: KillSignal = "TERM"


class AckData(_Model):
    seq: NonNegInt


class ErrorData(_Model):
    code: Text
    detail: Text


class EmptyData(_Model):
    pass


# ---------------------------------------------------------------- terminals
# A terminal is a PTY on the node (``agents.terminal``) running the login shell of
# a running interactive job's account. Its frames are volatile: never spooled,
# acked or replayed; what a viewer missed comes back from the agent's scrollback
# when it attaches again.

# The portal names each terminal (random, unguessable: it routes the output).
TerminalId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{16,64}$")]
TerminalSize = Annotated[int, Field(ge=1, le=1000)]
# Largest input or output one terminal frame carries, in characters.
MAX_TERMINAL_CHARS = 64 * 1024


class TerminalOpenData(_Model):
    """Start terminal ``terminal_id`` for the attempt, or attach to it again if
    it runs (the agent then replays its scrollback). ``command``: run that one
    command in the shell (``sh -c``) instead of an interactive login shell."""

    terminal_id: TerminalId
    attempt_id: PosInt
    job_id: PosInt
    cols: TerminalSize = 80
    rows: TerminalSize = 24
    # Who attaches (the portal's name for one viewer's socket): an open sent
    # again by the same viewer attaches it once.
    viewer: Annotated[str, Field(max_length=64)] = ""
    command: (
        Annotated[str, Field(min_length=1, max_length=MAX_COMMAND_CHARS)] | None
    ) = None


class TerminalInputData(_Model):
    terminal_id: TerminalId
    data: Annotated[str, Field(min_length=1, max_length=MAX_TERMINAL_CHARS)]


class TerminalResizeData(_Model):
    terminal_id: TerminalId
    cols: TerminalSize
    rows: TerminalSize


class TerminalCloseData(_Model):
    """``detach``: a viewer left (the PTY lingers for the agent's
    ``--terminal-linger``, so that it can attach again); else hang it up."""

    terminal_id: TerminalId
    detach: bool = False
    viewer: Annotated[str, Field(max_length=64)] = ""


class TerminalOutputData(_Model):
    """What the PTY wrote (UTF-8, undecodable bytes replaced). ``replay``: the
    scrollback, sent on attaching again (the viewer clears its screen first)."""

    terminal_id: TerminalId
    job_id: PosInt
    data: Annotated[str, Field(max_length=MAX_TERMINAL_CHARS)]
    replay: bool = False
    # This terminal's output frames counted by the agent (1, 2, ...): a viewer
    # that sees a gap knows output was lost on the way (a full channel).
    n: NonNegInt = 0


class TerminalExitData(_Model):
    """The terminal ended: ``code`` is its shell's exit status (128+N if killed
    by signal N), None if it never started or was hung up (``message`` says
    why)."""

    terminal_id: TerminalId
    job_id: PosInt
    code: int | None
    message: Text = ""


# ---------------------------------------------------------------- envelopes


class _Envelope(_Model):
    v: Literal[2] = PROTOCOL_VERSION
    seq: NonNegInt
    ts: Timestamp


class Hello(_Envelope):
    type: Literal["hello"] = "hello"
    data: HelloData


class Heartbeat(_Envelope):
    type: Literal["heartbeat"] = "heartbeat"
    data: HeartbeatData = HeartbeatData()


class Metrics(_Envelope):
    type: Literal["metrics"] = "metrics"
    data: MetricsData


class JobStarted(_Envelope):
    type: Literal["job.started"] = "job.started"
    data: JobStartedData


class JobExited(_Envelope):
    type: Literal["job.exited"] = "job.exited"
    data: JobExitedData


class JobLog(_Envelope):
    type: Literal["job.log"] = "job.log"
    data: JobLogData


class JobProgress(_Envelope):
    type: Literal["job.progress"] = "job.progress"
    data: JobProgressData


class JobLaunch(_Envelope):
    type: Literal["job.launch"] = "job.launch"
    data: JobLaunchData


class JobKill(_Envelope):
    type: Literal["job.kill"] = "job.kill"
    data: JobKillData


class NodeDrain(_Envelope):
    type: Literal["node.drain"] = "node.drain"
    data: EmptyData = EmptyData()


class Ack(_Envelope):
    type: Literal["ack"] = "ack"
    data: AckData


class Error(_Envelope):
    type: Literal["error"] = "error"
    data: ErrorData


class TerminalOpen(_Envelope):
    type: Literal["terminal.open"] = "terminal.open"
    data: TerminalOpenData


class TerminalInput(_Envelope):
    type: Literal["terminal.input"] = "terminal.input"
    data: TerminalInputData


class TerminalResize(_Envelope):
    type: Literal["terminal.resize"] = "terminal.resize"
    data: TerminalResizeData


class TerminalClose(_Envelope):
    type: Literal["terminal.close"] = "terminal.close"
    data: TerminalCloseData


class TerminalOutput(_Envelope):
    type: Literal["terminal.output"] = "terminal.output"
    data: TerminalOutputData


class TerminalExit(_Envelope):
    type: Literal["terminal.exit"] = "terminal.exit"
    data: TerminalExitData


AgentMessage = Annotated[
    Hello
    | Heartbeat
    | Metrics
    | JobStarted
    | JobExited
    | JobLog
    | JobProgress
    | TerminalOutput
    | TerminalExit,
    Field(discriminator="type"),
]
ServerMessage = Annotated[
    JobLaunch
    | JobKill
    | NodeDrain
    | Ack
    | Error
    | TerminalOpen
    | TerminalInput
    | TerminalResize
    | TerminalClose,
    Field(discriminator="type"),
]

# Messages the agent spools to disk, acked by the server (each with its own seq; the
# agent clears by send order). Job lifecycle and logs are never lost. Metrics are
# spooled only while the agent is disconnected (downsampled) and replayed with their
# original ``sampled_at``; the server stores a sample once. Progress always goes
# through the spool (one frame per job per 10 s at most), so the latest step
# survives a dropped connection; the server ignores a report not newer than the one
# it has. Both are DROPPABLE: the oldest go first when the spool is full.
DURABLE_TYPES = frozenset(
    {"job.started", "job.exited", "job.log", "metrics", "job.progress"}
)
DROPPABLE_TYPES = frozenset({"metrics", "job.progress"})
# Terminal frames are neither: sent only while connected, never acked.
TERMINAL_TYPES = frozenset({"terminal.output", "terminal.exit"})

_agent_adapter: TypeAdapter[AgentMessage] = TypeAdapter(AgentMessage)
_server_adapter: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


class ProtocolError(ValueError):
    """A frame that is not a valid message; ``str()`` names what is wrong."""


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "(message)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_agent_message(raw: str | bytes) -> AgentMessage:
    """Validate one agent -> server frame. Raises ``ProtocolError``."""
    if len(raw) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(raw)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return _agent_adapter.validate_json(raw, strict=True)
    except ValidationError as exc:
        raise ProtocolError(_explain(exc)) from None


def parse_server_message(raw: str | bytes) -> ServerMessage:
    """Validate one server -> agent frame. Raises ``ProtocolError``."""
    if len(raw) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(raw)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return _server_adapter.validate_json(raw, strict=True)
    except ValidationError as exc:
        raise ProtocolError(_explain(exc)) from None
