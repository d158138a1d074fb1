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
        # nvmlDeviceGetSamples for GPU utilisation until the GPU lacks it.
        self.util_samples = True
        count = nvml.nvmlDeviceGetCount()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        # Per GPU, NVML's timestamp (us) of the newest utilisation sample read, of
        # the GPU and of its processes: the next read takes the samples after it.
        self.util_seen = [0] * count
        self.process_seen = [0] * count
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
        busy = self._util_since(i, h)
        if busy is None and util is not None:
            busy = _pct(util.gpu)
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
        sm = self._process_util_since(i, h) if procs else {}
        return GpuSample(
            index=i,
            uuid=self.uuids[i],
            util_gpu=busy,
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

    def _util_since(self, i: int, h: object) -> float | None:
        """The GPU's utilisation over the time since the last read: the mean of
        NVML's own samples after it (``nvmlDeviceGetSamples``). NVML's instant
        reading (``nvmlDeviceGetUtilizationRates``) covers only its last sample
        period (1/6 s to 1 s), so one a second misses most of each second: a
        sub-second idle gap is seen whole or not at all. None where the GPU keeps
        no samples or none is new (the caller falls back to the instant)."""
        if not self.util_samples:
            return None
        try:
            kind, samples = self.nvml.nvmlDeviceGetSamples(
                h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, self.util_seen[i]
            )
        except pynvml.NVMLError_GpuIsLost:
            raise GpuLost from None
        except pynvml.NVMLError_NotFound:
            return None  # no sample since the last read
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            self.util_samples = False
            return None
        except pynvml.NVMLError as e:
            self.errors += 1
            log.debug("NVML read failed: %s", e)
            return None
        new = [s for s in samples if s.timeStamp > self.util_seen[i]]
        if not new:
            return None
        self.util_seen[i] = max(s.timeStamp for s in new)
        field = _VALUE_FIELDS.get(kind, "uiVal")
        return _pct(sum(getattr(s.sampleValue, field) for s in new) / len(new))

    def _process_util_since(self, i: int, h: object) -> dict[int, float]:
        """Each process's mean SM utilisation over NVML's samples since the last
        read. A process without a new sample (none has one when NVML answers
        NotFound) is left out: its utilisation is unknown, not 0 (NVML documents
        that it keeps samples of busy processes only, but an unknown stays out
        of the busy fractions the co-location model learns from)."""
        try:
            samples = self.nvml.nvmlDeviceGetProcessUtilization(h, self.process_seen[i])
        except pynvml.NVMLError_GpuIsLost:
            raise GpuLost from None
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_NotSupported):
            return {}
        except pynvml.NVMLError as e:
            self.errors += 1
            log.debug("NVML read failed: %s", e)
            return {}
        seen = self.process_seen[i]
        values: dict[int, list[float]] = {}
        for s in samples:
            if s.timeStamp > seen:
                values.setdefault(s.pid, []).append(_pct(s.smUtil))
                self.process_seen[i] = max(self.process_seen[i], s.timeStamp)
        return {pid: sum(v) / len(v) for pid, v in values.items()}


# nvmlDeviceGetSamples' value type -> the field of its nvmlValue_t union.
_VALUE_FIELDS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
}


def _pct(value: float) -> float:
    return float(min(100, max(0, value)))


class _suppress_nvml:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        return exc_type is not None and issubclass(exc_type, pynvml.NVMLError)
