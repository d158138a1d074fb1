"""A simulated node: a module-like object with pynvml's API, driven by a node spec.

``SimNvml(parse_node_spec("4xA100-80GB"))`` exposes the pynvml functions the reader
uses, pynvml's constants, and raises pynvml's real exception classes, so the same
``NvmlReader`` runs over it. Its numbers follow the jobs the agent runs: the agent
calls ``attach(attempt_id, gpu_uuids, pid, env)`` when a job's command starts and
``detach(attempt_id)`` when it ends. A job's env may set ``GPULAB_SIM_UTIL`` (percent,
default 60) and ``GPULAB_SIM_MEM_MIB`` (default 2048).

Model (deterministic; time comes from ``clock``):
- util = min(100, sum of the jobs' demands); each job's own SM share is its demand
  divided by ``1 + CONTENTION * (jobs on the GPU - 1)`` (sharing slows everyone);
- memory = IDLE_MEM_MIB + the jobs' memory, capped at the GPU's total;
- temperature = 30 C + 0.5 C per util point; power = idle 50 W rising linearly to the
  power limit at 100 %; the energy counter integrates power over clock time.

- topology (``nvmlDeviceGetTopologyCommonAncestor``), by index: GPUs 2k and 2k+1 share
  one PCIe switch (level 10, SINGLE), GPUs in the same group of four sit under
  multiple switches (20, MULTIPLE), the rest of the same half of the node (halves of
  at least four GPUs) is on the same NUMA node (40, NODE), the other half is across
  the CPU interconnect (50, SYSTEM); e.g. on 8 GPUs: 0-1 10, 0-2 20, 0-4 50. NVLink (``:nvlink``: every GPU linked to every other) does not change
  these PCIe levels; it is reported as ``nvlink_peers``.

Faults: tests set ``lost`` (indexes that raise GpuIsLost) and ``unsupported`` (names
of functions that raise NotSupported); a simulation file schedules them.

Simulation file (``--simulate node.json`` or ``node.yaml``; YAML needs PyYAML)::

    {"gpus": {"count": 4, "model": "A100", "memory_gb": 80},   # or memory_mib;
     "nvlink": false,                                         # default: from model
     "faults": {
       "gpu_lost": [{"index": 1, "at": 30}],
       "ecc_errors": [{"index": 0, "at": 10, "count": 3}],
       "unsupported": ["nvmlDeviceGetTotalEnergyConsumption"]}}

``at`` is seconds after the simulator started (the agent's start). From then a lost
GPU raises NVMLError_GpuIsLost for every call (samples say ``lost``); an ECC fault
adds ``count`` to the GPU's uncorrected volatile ECC counter; an unsupported function
raises NVMLError_NotSupported for every GPU (the field is absent, None).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated, Any

import pynvml  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.spec import (
    MAX_GPUS_PER_NODE,
    NodeSpec,
    SpecError,
    model_memory_mib,
    parse_node_spec,
)

if TYPE_CHECKING:
    from collections.abc import Callable

MIB = 1024 * 1024
IDLE_MEM_MIB = 256
IDLE_TEMP_C = 30.0
IDLE_POWER_W = 50.0
CONTENTION = 0.25
DEFAULT_UTIL = 60.0
DEFAULT_MEM_MIB = 2048
DRIVER_VERSION = "550.54.15"
CUDA_DRIVER_VERSION = 12040


def power_limit_w(model: str) -> float:
    m = model.upper()
    if "H100" in m or "H200" in m:
        return 700.0
    if "A100" in m:
        return 400.0
    return 300.0


def sim_uuid(hostname: str, index: int) -> str:
    """Stable fake GPU uuid for (hostname, index)."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{hostname}.gpulab/gpu{index}"))


def _err(code: int) -> pynvml.NVMLError:
    # pynvml.NVMLError(code) returns the matching subclass (NVMLError_NotSupported...).
    return pynvml.NVMLError(code)


@dataclass
class _SimJob:
    attempt_id: int
    pid: int
    util: float
    mem_mib: int


@dataclass
class _SimGpu:
    index: int
    uuid: str
    jobs: dict[int, _SimJob] = field(default_factory=dict)
    energy_mj: float = 0.0
    last_t: float = 0.0


@dataclass(frozen=True)
class _Handle:
    index: int


def _env_number(env: dict[str, str], name: str, default: float) -> float:
    try:
        return max(0.0, float(env.get(name, default)))
    except ValueError:
        return default


# ---------------------------------------------------------------- simulation files


class _FileModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


NonNegInt = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]


class _GpusSection(_FileModel):
    count: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]
    model: Annotated[str, Field(min_length=1, max_length=64)]
    memory_gb: Annotated[int, Field(ge=1)] | None = None
    memory_mib: Annotated[int, Field(ge=1)] | None = None


class _LostFault(_FileModel):
    index: NonNegInt
    at: Seconds = 0.0


class _EccFault(_FileModel):
    index: NonNegInt
    at: Seconds = 0.0
    count: Annotated[int, Field(ge=1)] = 1


class _FaultsSection(_FileModel):
    gpu_lost: list[_LostFault] = []
    ecc_errors: list[_EccFault] = []
    unsupported: list[str] = []


class _SimFile(_FileModel):
    gpus: _GpusSection
    nvlink: bool = False
    faults: _FaultsSection = _FaultsSection()


@dataclass
class SimFaults:
    """Faults scheduled in seconds after the simulator starts."""

    gpu_lost: dict[int, float] = field(default_factory=dict)  # index -> at
    ecc_errors: list[tuple[int, float, int]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)


SIM_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def is_sim_file(value: str) -> bool:
    """``--simulate`` names a file (not a node spec)."""
    return value.lower().endswith(SIM_FILE_SUFFIXES) or Path(value).is_file()


def _load_document(path: Path) -> object:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            raise SpecError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml);"
                " or write the file as JSON"
            ) from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError(
                f"{path} is not valid YAML: {' '.join(str(exc).split())}"
            ) from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SpecError(f"{path} is not valid JSON: {exc}") from None


def load_sim_file(path: str | Path) -> tuple[NodeSpec, SimFaults]:
    """Read a simulation file (format in the module docstring). Raises ``SpecError``
    naming the file and what is wrong."""
    path = Path(path)
    doc = _load_document(path)
    if not isinstance(doc, dict):
        raise SpecError(f"{path}: expected a mapping with a 'gpus' section at the top")
    try:
        sim = _SimFile.model_validate(doc)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"]) or "(file)"
            parts.append(f"{loc}: {err['msg']}")
        raise SpecError(f"{path}: " + "; ".join(parts)) from None
    g = sim.gpus
    if g.memory_gb is not None and g.memory_mib is not None:
        raise SpecError(f"{path}: gpus: give memory_gb or memory_mib, not both")
    if g.memory_mib is not None:
        memory = g.memory_mib
    elif g.memory_gb is not None:
        memory = g.memory_gb * 1024
    else:
        try:
            memory = model_memory_mib(g.model)
        except SpecError as exc:
            raise SpecError(f"{path}: gpus.model: {exc} (or set memory_gb)") from None
    indexed: list[tuple[str, int]] = [
        (f"gpu_lost.{n}", f.index) for n, f in enumerate(sim.faults.gpu_lost)
    ] + [(f"ecc_errors.{n}", f.index) for n, f in enumerate(sim.faults.ecc_errors)]
    for where, index in indexed:
        if index >= g.count:
            raise SpecError(
                f"{path}: faults.{where}.index: GPU {index} does not exist"
                f" (the node has {g.count} GPUs, 0-{g.count - 1})"
            )
    for name in sim.faults.unsupported:
        if not (name.startswith("nvml") and callable(getattr(SimNvml, name, None))):
            raise SpecError(
                f"{path}: faults.unsupported: {name!r} is not an NVML function the"
                " simulator provides"
            )
    lost: dict[int, float] = {}
    for f in sim.faults.gpu_lost:
        lost[f.index] = min(f.at, lost.get(f.index, f.at))
    faults_out = SimFaults(
        gpu_lost=lost,
        ecc_errors=[(f.index, f.at, f.count) for f in sim.faults.ecc_errors],
        unsupported=set(sim.faults.unsupported),
    )
    return NodeSpec(g.count, g.model, memory, sim.nvlink), faults_out


def load_simulation(value: str) -> tuple[NodeSpec, SimFaults]:
    """``--simulate``: a node spec or a simulation file. Raises ``SpecError``."""
    if is_sim_file(value):
        return load_sim_file(value)
    return parse_node_spec(value), SimFaults()


def topology_level(a: int, b: int, count: int) -> int:
    """NVML common-ancestor level between GPUs ``a`` and ``b`` of a ``count``-GPU
    simulated node (the model in the module docstring)."""
    half = max(4, (count + 1) // 2)
    if a == b:
        return int(pynvml.NVML_TOPOLOGY_INTERNAL)
    if a // 2 == b // 2:
        return int(pynvml.NVML_TOPOLOGY_SINGLE)
    if a // 4 == b // 4:
        return int(pynvml.NVML_TOPOLOGY_MULTIPLE)
    if a // half == b // half:
        return int(pynvml.NVML_TOPOLOGY_NODE)
    return int(pynvml.NVML_TOPOLOGY_SYSTEM)


# ---------------------------------------------------------------- the simulator


class SimNvml:
    """Module-like stand-in for ``pynvml`` describing the node ``spec``."""

    def __init__(
        self,
        spec: NodeSpec,
        hostname: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        faults: SimFaults | None = None,
    ) -> None:
        self.spec = spec
        self.hostname = hostname or socket.gethostname()
        self.clock = clock
        self.started = clock()
        self.faults = faults or SimFaults()
        self.lost: set[int] = set()
        self.unsupported: set[str] = set(self.faults.unsupported)
        self.initialized = False
        self._lock = threading.RLock()
        now = clock()
        self._gpus = [
            _SimGpu(i, sim_uuid(self.hostname, i), last_t=now) for i in range(spec.gpus)
        ]

    def __getattr__(self, name: str) -> Any:
        # pynvml's constants and exception classes (NVML_*, NVMLError*).
        if name.startswith(("NVML", "NVMLError")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # ------------------------------------------------------------ job hooks

    def attach(
        self, attempt_id: int, gpu_uuids: list[str], pid: int, env: dict[str, str]
    ) -> None:
        """A job's command (``pid``) now runs on ``gpu_uuids``."""
        util = min(100.0, _env_number(env, "GPULAB_SIM_UTIL", DEFAULT_UTIL))
        mem = int(_env_number(env, "GPULAB_SIM_MEM_MIB", DEFAULT_MEM_MIB))
        with self._lock:
            for gpu in self._gpus:
                if gpu.uuid in gpu_uuids:
                    self._advance(gpu)
                    gpu.jobs[attempt_id] = _SimJob(attempt_id, pid, util, mem)

    def detach(self, attempt_id: int) -> None:
        with self._lock:
            for gpu in self._gpus:
                if attempt_id in gpu.jobs:
                    self._advance(gpu)
                    del gpu.jobs[attempt_id]

    # ------------------------------------------------------------ model

    def _util(self, gpu: _SimGpu) -> float:
        return min(100.0, sum(j.util for j in gpu.jobs.values()))

    def _mem_used_mib(self, gpu: _SimGpu) -> int:
        used = IDLE_MEM_MIB + sum(j.mem_mib for j in gpu.jobs.values())
        return min(self.spec.memory_mib, used)

    def _power_w(self, gpu: _SimGpu) -> float:
        limit = power_limit_w(self.spec.model)
        return IDLE_POWER_W + (limit - IDLE_POWER_W) * self._util(gpu) / 100

    def _advance(self, gpu: _SimGpu) -> None:
        now = self.clock()
        gpu.energy_mj += self._power_w(gpu) * 1000 * max(0.0, now - gpu.last_t)
        gpu.last_t = now

    def _gpu(self, handle: _Handle, fn: str) -> _SimGpu:
        if not self.initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        if fn in self.unsupported:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if handle.index in self.lost or self._lost_by_fault(handle.index):
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpus[handle.index]

    def _lost_by_fault(self, index: int) -> bool:
        at = self.faults.gpu_lost.get(index)
        return at is not None and self.clock() - self.started >= at

    # ------------------------------------------------------------ pynvml API

    def nvmlInit(self) -> None:
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return DRIVER_VERSION

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return CUDA_DRIVER_VERSION

    def nvmlDeviceGetCount(self) -> int:
        return self.spec.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < self.spec.gpus:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        self._gpu(h, "nvmlDeviceGetName")
        return f"NVIDIA {self.spec.model}"

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> Any:
        gpu = self._gpu(h, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=f"00000000:{gpu.index + 1:02X}:00.0")

    def nvmlDeviceGetMemoryInfo(self, h: _Handle, version: int | None = None) -> Any:
        """Version 1 (``version`` None) or 2 (``pynvml.nvmlMemory_v2``: with
        ``reserved``, which a simulated GPU has none of)."""
        gpu = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        with self._lock:
            used = self._mem_used_mib(gpu)
        total = self.spec.memory_mib
        memory = SimpleNamespace(
            total=total * MIB, used=used * MIB, free=(total - used) * MIB
        )
        if version is not None:
            memory.version, memory.reserved = version, 0
        return memory

    def nvmlDeviceGetUtilizationRates(self, h: _Handle) -> Any:
        gpu = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        with self._lock:
            util = self._util(gpu)
        return SimpleNamespace(gpu=int(util), memory=int(util / 2))

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            return int(IDLE_TEMP_C + 0.5 * self._util(gpu))

    def nvmlDeviceGetPowerUsage(self, h: _Handle) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetPowerUsage")
        with self._lock:
            return int(self._power_w(gpu) * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, h: _Handle) -> int:
        self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit")
        return int(power_limit_w(self.spec.model) * 1000)

    def nvmlDeviceGetClockInfo(self, h: _Handle, clock_type: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetClockInfo")
        with self._lock:
            return 1410 if gpu.jobs else 210

    def nvmlDeviceGetPcieThroughput(self, h: _Handle, counter: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetPcieThroughput")
        with self._lock:
            return int(self._util(gpu) * 100)

    def nvmlDeviceGetTotalEccErrors(self, h: _Handle, kind: int, counter: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        if not self.faults.ecc_errors:
            return 0
        elapsed = self.clock() - self.started
        return sum(
            count
            for index, at, count in self.faults.ecc_errors
            if index == gpu.index and elapsed >= at
        )

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: _Handle, h2: _Handle) -> int:
        a = self._gpu(h1, "nvmlDeviceGetTopologyCommonAncestor")
        b = self._gpu(h2, "nvmlDeviceGetTopologyCommonAncestor")
        return topology_level(a.index, b.index, self.spec.gpus)

    def nvmlDeviceGetTotalEnergyConsumption(self, h: _Handle) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption")
        with self._lock:
            self._advance(gpu)
            return int(gpu.energy_mj)

    def nvmlDeviceGetMigMode(self, h: _Handle) -> list[int]:
        self._gpu(h, "nvmlDeviceGetMigMode")
        off = pynvml.NVML_DEVICE_MIG_DISABLE
        return [off, off]

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[Any]:
        gpu = self._gpu(h, "nvmlDeviceGetComputeRunningProcesses")
        with self._lock:
            return [
                SimpleNamespace(pid=j.pid, usedGpuMemory=j.mem_mib * MIB)
                for j in gpu.jobs.values()
            ]

    def _stamp(self, since: int) -> int:
        """A sample's NVML timestamp (us): a simulated GPU samples at every read."""
        return max(since + 1, int(self.clock() * 1e6))

    def nvmlDeviceGetSamples(
        self, h: _Handle, sampling_type: int, since: int
    ) -> tuple[int, list[Any]]:
        gpu = self._gpu(h, "nvmlDeviceGetSamples")
        if sampling_type != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            util = self._util(gpu)
        sample = SimpleNamespace(
            timeStamp=self._stamp(since), sampleValue=SimpleNamespace(uiVal=int(util))
        )
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [sample]

    def nvmlDeviceGetProcessUtilization(self, h: _Handle, since: int) -> list[Any]:
        gpu = self._gpu(h, "nvmlDeviceGetProcessUtilization")
        with self._lock:
            slow = 1 + CONTENTION * (len(gpu.jobs) - 1)
            stamp = self._stamp(since)
            return [
                SimpleNamespace(pid=j.pid, smUtil=int(j.util / slow), timeStamp=stamp)
                for j in gpu.jobs.values()
            ]

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetNvLinkState")
        if not self.spec.nvlink:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= self.spec.gpus - 1:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        del gpu
        return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: _Handle, link: int) -> Any:
        gpu = self._gpu(h, "nvmlDeviceGetNvLinkRemotePciInfo")
        peers = [i for i in range(self.spec.gpus) if i != gpu.index]
        return self.nvmlDeviceGetPciInfo(_Handle(peers[link]))
