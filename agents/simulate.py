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

Tests inject faults with ``lost`` (indexes that raise GpuIsLost) and ``unsupported``
(names of functions that raise NotSupported).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pynvml  # type: ignore[import-untyped]

if TYPE_CHECKING:
    from collections.abc import Callable

    from agents.spec import NodeSpec

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


class SimNvml:
    """Module-like stand-in for ``pynvml`` describing the node ``spec``."""

    def __init__(
        self,
        spec: NodeSpec,
        hostname: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.hostname = hostname or socket.gethostname()
        self.clock = clock
        self.lost: set[int] = set()
        self.unsupported: set[str] = set()
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
        if handle.index in self.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpus[handle.index]

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

    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> Any:
        gpu = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        with self._lock:
            used = self._mem_used_mib(gpu)
        total = self.spec.memory_mib
        return SimpleNamespace(
            total=total * MIB, used=used * MIB, free=(total - used) * MIB
        )

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
        self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        return 0

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

    def nvmlDeviceGetProcessUtilization(self, h: _Handle, since: int) -> list[Any]:
        gpu = self._gpu(h, "nvmlDeviceGetProcessUtilization")
        with self._lock:
            slow = 1 + CONTENTION * (len(gpu.jobs) - 1)
            return [
                SimpleNamespace(pid=j.pid, smUtil=int(j.util / slow))
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
