"""Read GPUs through NVML: one ``NvmlReader`` over pynvml or over the simulator.

``NvmlReader(nvml)`` takes any module-like object with pynvml's functions, constants
and exception classes (the real ``pynvml`` module or ``agents.simulate.SimNvml``).
A metric the GPU does not support (``NVMLError_NotSupported``, or any other error for
that one call) becomes ``None``; a GPU that fell off the bus (``NVMLError_GpuIsLost``)
is reported with ``lost=True``; nothing raises out of ``sample()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import pynvml  # type: ignore[import-untyped]

from agents.protocol import GpuInfo, GpuSample, ProcessSample, TopologyLink

log = logging.getLogger(__name__)

T = TypeVar("T")
MIB = 1024 * 1024
# Lookup from a pid to the attempt that owns it (None: a foreign process).
Owner = Callable[[int], int | None]


class NvmlUnavailable(RuntimeError):
    """NVML cannot start here (no driver, no library); the message says what to do."""


class GpuLost(Exception):
    """Raised inside the reader when a GPU reports NVMLError_GpuIsLost."""


class GpuReader(Protocol):
    """What the agent needs from a GPU backend."""

    driver_version: str | None
    cuda_version: str | None

    def gpus(self) -> list[GpuInfo]: ...

    def sample(self, owner: Owner) -> list[GpuSample]: ...

    def close(self) -> None: ...


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """``GpuReader`` over a pynvml-like module. Call ``close()`` when done."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except (
            pynvml.NVMLError_LibraryNotFound,
            pynvml.NVMLError_DriverNotLoaded,
        ) as e:
            raise NvmlUnavailable(
                f"no NVIDIA driver found on this machine: {e}; "
                "use --simulate SPEC to run a simulated node"
            ) from None
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(
                f"NVML failed to start: {e}; use --simulate SPEC to run a simulated node"
            ) from None
        self.errors = 0  # metric reads that failed for another reason than support
        self.driver_version = self._opt(
            lambda: _text(nvml.nvmlSystemGetDriverVersion())
        )
        cuda = self._opt(nvml.nvmlSystemGetCudaDriverVersion)
        self.cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None
        # nvmlDeviceGetMemoryInfo_v2 until the library or driver lacks it.
        self.memory_v2 = True
        count = nvml.nvmlDeviceGetCount()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.uuids = [self._uuid(i, h) for i, h in enumerate(self.handles)]

    def _uuid(self, index: int, handle: object) -> str:
        try:
            uuid = self._opt(lambda: _text(self.nvml.nvmlDeviceGetUUID(handle)))
        except GpuLost:
            log.warning("GPU %d is lost (fell off the bus) at startup", index)
            uuid = None
        return uuid or f"GPU-unknown-{index}"

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            log.warning("nvmlShutdown failed: %s", e)

    # ------------------------------------------------------------ helpers

    def _opt(self, read: Callable[[], T]) -> T | None:
        """``read()``, None if unsupported or failing; GpuLost propagates."""
        try:
            return read()
        except pynvml.NVMLError_GpuIsLost:
            raise GpuLost from None
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError as e:
            self.errors += 1
            log.debug("NVML read failed: %s", e)
            return None

    # ------------------------------------------------------------ hello

    def gpus(self) -> list[GpuInfo]:
        nvml = self.nvml
        bus_ids: dict[str, int] = {}
        for i, h in enumerate(self.handles):
            with _suppress_nvml():
                bus_ids[_text(nvml.nvmlDeviceGetPciInfo(h).busId).lower()] = i
        infos = []
        for i, h in enumerate(self.handles):
            try:
                name = self._opt(lambda: _text(nvml.nvmlDeviceGetName(h)))
                mem = self._opt(lambda: nvml.nvmlDeviceGetMemoryInfo(h).total)
                mig = self._opt(lambda: nvml.nvmlDeviceGetMigMode(h))
                peers = self._nvlink_peers(h, bus_ids)
                topology = self._topology(i, h)
            except GpuLost:
                name, mem, mig, peers, topology = None, None, None, set(), []
            infos.append(
                GpuInfo(
                    index=i,
                    uuid=self.uuids[i],
                    name=name or "unknown GPU",
                    memory_total_mib=max(1, int(mem // MIB)) if mem else 1,
                    nvlink_peers=sorted(p for p in peers if p != i),
                    topology=topology,
                    mig_enabled=bool(mig and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE),
                )
            )
        return infos

    def _topology(self, index: int, handle: object) -> list[TopologyLink]:
        """Common-ancestor level to every other GPU; unsupported -> no entries."""
        links = []
        for peer, other in enumerate(self.handles):
            if peer == index:
                continue
            try:
                level = self.nvml.nvmlDeviceGetTopologyCommonAncestor(handle, other)
            except pynvml.NVMLError_NotSupported:
                return []
            except pynvml.NVMLError_GpuIsLost:
                continue  # the peer is lost (this GPU's own loss shows elsewhere)
            except pynvml.NVMLError as e:
                self.errors += 1
                log.debug("NVML topology read failed: %s", e)
                continue
            if 0 <= int(level) <= 100:
                links.append(TopologyLink(peer=peer, level=int(level)))
        return links

    def _nvlink_peers(self, handle: object, bus_ids: dict[str, int]) -> set[int]:
        nvml = self.nvml
        peers: set[int] = set()
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != 1:
                    continue
                remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
            except pynvml.NVMLError_GpuIsLost:
                raise GpuLost from None
            except pynvml.NVMLError:
                # NotSupported / InvalidArgument: no (more) links on this GPU.
                break
            peer = bus_ids.get(_text(remote.busId).lower())
            if peer is not None:
                peers.add(peer)
        return peers

    # ------------------------------------------------------------ metrics

    def _memory(self, h: object) -> Any:
        """Memory as ``nvidia-smi`` shows it. Version 2 of the call counts the
        memory the driver reserves apart (``reserved``); version 1 counts it as
        used (614 MiB more on an H200 with driver 580, docs/real-gpu.md). Version
        1 where the library or driver lacks version 2."""
        if self.memory_v2:
            try:
                return self.nvml.nvmlDeviceGetMemoryInfo(
                    h, version=pynvml.nvmlMemory_v2
                )
            except pynvml.NVMLError_GpuIsLost:
                raise GpuLost from None
            except (
                pynvml.NVMLError_FunctionNotFound,
                pynvml.NVMLError_NotSupported,
                pynvml.NVMLError_ArgumentVersionMismatch,
            ) as e:
                log.info("NVML memory info v2 unavailable (%s): using v1", e)
                self.memory_v2 = False
            except pynvml.NVMLError as e:
                self.errors += 1
                log.debug("NVML read failed: %s", e)
                return None
            except TypeError:  # a pynvml older than 11.510: no ``version``
                self.memory_v2 = False
        return self._opt(lambda: self.nvml.nvmlDeviceGetMemoryInfo(h))

    def sample(self, owner: Owner) -> list[GpuSample]:
        samples = []
        for i, h in enumerate(self.handles):
            try:
                samples.append(self._sample_one(i, h, owner))
            except GpuLost:
                samples.append(GpuSample(index=i, uuid=self.uuids[i], lost=True))
        return samples

    def _sample_one(self, i: int, h: object, owner: Owner) -> GpuSample:
        nvml = self.nvml
        mem = self._memory(h)
        util = self._opt(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        temp = self._opt(
            lambda: nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        )
        power = self._opt(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        limit = self._opt(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h))
        clock = self._opt(lambda: nvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
        rx = self._opt(
            lambda: nvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        )
        tx = self._opt(
            lambda: nvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        )
        ecc = self._opt(
            lambda: nvml.nvmlDeviceGetTotalEccErrors(
                h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
        energy = self._opt(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
        procs = self._opt(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(h)) or []
        sm: dict[int, float] = {}
        if procs:
            for s in (
                self._opt(lambda: nvml.nvmlDeviceGetProcessUtilization(h, 0)) or []
            ):
                sm[s.pid] = _pct(s.smUtil)
        return GpuSample(
            index=i,
            uuid=self.uuids[i],
            util_gpu=_pct(util.gpu) if util is not None else None,
            util_mem=_pct(util.memory) if util is not None else None,
            memory_used_mib=int(mem.used // MIB) if mem is not None else None,
            memory_total_mib=int(mem.total // MIB) if mem is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            power_w=power / 1000 if power is not None else None,
            power_limit_w=limit / 1000 if limit is not None else None,
            sm_clock_mhz=int(clock) if clock is not None else None,
            pcie_rx_kib_s=int(rx) if rx is not None else None,
            pcie_tx_kib_s=int(tx) if tx is not None else None,
            ecc_uncorrected=int(ecc) if ecc is not None else None,
            energy_mj=int(energy) if energy is not None else None,
            processes=[
                ProcessSample(
                    pid=p.pid,
                    used_memory_mib=(
                        int(p.usedGpuMemory // MIB) if p.usedGpuMemory else None
                    ),
                    sm_util=sm.get(p.pid),
                    attempt_id=owner(p.pid),
                )
                for p in procs[:256]
            ],
        )


def _pct(value: float) -> float:
    return float(min(100, max(0, value)))


class _suppress_nvml:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        return exc_type is not None and issubclass(exc_type, pynvml.NVMLError)
