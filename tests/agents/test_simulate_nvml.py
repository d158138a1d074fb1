"""The simulator and NvmlReader: one reader over pynvml's API and its real errors."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from agents.nvml import NvmlReader, NvmlUnavailable
from agents.simulate import SimNvml, sim_uuid
from agents.spec import parse_node_spec


def make(spec: str = "4xA100-80GB", **kw: object) -> tuple[SimNvml, NvmlReader]:
    sim = SimNvml(parse_node_spec(spec), hostname="node-a", **kw)  # type: ignore[arg-type]
    return sim, NvmlReader(sim)


def no_owner(_pid: int) -> None:
    return None


def test_hello_facts_follow_the_spec() -> None:
    _, reader = make("4xA100-80GB:nvlink")
    gpus = reader.gpus()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert {g.name for g in gpus} == {"NVIDIA A100-80GB"}
    assert {g.memory_total_mib for g in gpus} == {80 * 1024}
    assert gpus[1].nvlink_peers == [0, 2, 3]
    assert gpus[3].nvlink_peers == [0, 1, 2]
    assert not any(g.mig_enabled for g in gpus)
    assert reader.driver_version and reader.cuda_version == "12.4"
    # Stable uuids derived from hostname + index, distinct per GPU and per host.
    assert gpus[2].uuid == sim_uuid("node-a", 2)
    assert gpus[2].uuid.startswith("GPU-")
    assert len({g.uuid for g in gpus}) == 4
    assert sim_uuid("node-b", 2) != gpus[2].uuid


def test_no_nvlink_without_the_flag_and_known_model_memory() -> None:
    _, reader = make("2xp100")
    gpus = reader.gpus()
    assert [g.nvlink_peers for g in gpus] == [[], []]
    assert gpus[0].memory_total_mib == 16 * 1024


def test_idle_gpu_numbers() -> None:
    _, reader = make()
    s = reader.sample(no_owner)[0]
    assert s.util_gpu == 0
    assert s.memory_used_mib is not None and s.memory_used_mib < 1024
    assert s.memory_total_mib == 80 * 1024
    assert s.temperature_c == pytest.approx(30, abs=2)
    assert s.power_w == pytest.approx(50, abs=5)
    assert s.processes == []
    assert not s.lost


def test_numbers_follow_the_jobs() -> None:
    now = [100.0]
    sim, reader = make(clock=lambda: now[0])
    uuids = [g.uuid for g in reader.gpus()]
    idle = reader.sample(no_owner)
    sim.attach(
        7, [uuids[1]], 4242, {"GPULAB_SIM_UTIL": "70", "GPULAB_SIM_MEM_MIB": "10000"}
    )
    owners = {4242: 7}
    busy = reader.sample(owners.get)
    g1 = busy[1]
    assert g1.util_gpu == 70
    assert g1.memory_used_mib == idle[1].memory_used_mib + 10000
    assert g1.temperature_c > idle[1].temperature_c
    assert g1.power_w > idle[1].power_w
    assert [(p.pid, p.used_memory_mib, p.attempt_id) for p in g1.processes] == [
        (4242, 10000, 7)
    ]
    assert g1.processes[0].sm_util == 70
    assert busy[0].util_gpu == 0  # the other GPUs stay idle

    # A second job on the same GPU: util adds up (capped at 100), each is slowed.
    sim.attach(8, [uuids[1]], 4343, {"GPULAB_SIM_UTIL": "50"})
    shared = reader.sample(no_owner)[1]
    assert shared.util_gpu == 100
    by_pid = {p.pid: p for p in shared.processes}
    assert by_pid[4242].sm_util < 70
    assert by_pid[4343].sm_util < 50
    assert by_pid[4343].used_memory_mib == 2048  # the default
    assert all(p.attempt_id is None for p in shared.processes)  # foreign to no_owner

    # Energy integrates power over time.
    e0 = reader.sample(no_owner)[1].energy_mj
    now[0] += 10
    e1 = reader.sample(no_owner)[1].energy_mj
    assert e1 - e0 == pytest.approx(400 * 10 * 1000, rel=0.01)  # 100 % of 400 W

    sim.detach(7)
    sim.detach(8)
    assert reader.sample(no_owner)[1].util_gpu == 0


def test_not_supported_metric_is_none_not_zero() -> None:
    sim, reader = make()
    sim.unsupported |= {
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption",
    }
    s = reader.sample(no_owner)[0]
    assert s.power_w is None
    assert s.energy_mj is None
    assert s.temperature_c is not None  # the rest is still read


def test_lost_gpu_is_reported_lost_without_crashing() -> None:
    sim, reader = make()
    sim.lost.add(2)
    samples = reader.sample(no_owner)
    assert [s.lost for s in samples] == [False, False, True, False]
    assert samples[2].uuid == reader.uuids[2]
    assert samples[2].util_gpu is None
    assert reader.gpus()[2].uuid == reader.uuids[2]  # hello still works


class RaisingAtInit(SimNvml):
    def __init__(self, code: int) -> None:
        super().__init__(parse_node_spec("1xA100-80GB"), hostname="x")
        self.code = code

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(self.code)


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_no_driver_gives_a_clear_message(code: int) -> None:
    with pytest.raises(NvmlUnavailable) as info:
        NvmlReader(RaisingAtInit(code))
    msg = str(info.value)
    assert msg.startswith("no NVIDIA driver found on this machine: ")
    assert "use --simulate SPEC to run a simulated node" in msg
    assert "\n" not in msg


def test_fake_raises_pynvmls_real_classes() -> None:
    sim, _ = make()
    sim.lost.add(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlDeviceGetUtilizationRates(sim.nvmlDeviceGetHandleByIndex(0))
    assert sim.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU


def test_real_pynvml_without_a_driver_is_refused_clearly() -> None:
    # This machine has no NVIDIA driver: the real module must give the same message.
    try:
        reader = NvmlReader(pynvml)
    except NvmlUnavailable as exc:
        assert "use --simulate SPEC" in str(exc)
    else:  # pragma: no cover - a GPU machine: the real module works (test_gpu.py)
        assert reader.gpus()
        reader.close()


MIB = 1024 * 1024
RESERVED_MIB = 614  # what driver 580 reserves on an H200 (docs/real-gpu.md)


class ReservingNvml(SimNvml):
    """A driver that reserves memory: version 1 of nvmlDeviceGetMemoryInfo counts
    it as used, version 2 apart (``reserved``), as nvidia-smi shows it."""

    def __init__(self) -> None:
        super().__init__(parse_node_spec("2xH100-80GB"), hostname="x")
        self.v2_calls = 0

    def nvmlDeviceGetMemoryInfo(self, h: object, version: int | None = None) -> object:
        memory = super().nvmlDeviceGetMemoryInfo(h, version)  # type: ignore[arg-type]
        if version is None:
            memory.used += RESERVED_MIB * MIB
            memory.free -= RESERVED_MIB * MIB
        else:
            self.v2_calls += 1
            memory.reserved = RESERVED_MIB * MIB
        return memory


def test_memory_used_leaves_out_what_the_driver_reserves() -> None:
    sim = ReservingNvml()
    s = NvmlReader(sim).sample(no_owner)[0]
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    v1 = sim.nvmlDeviceGetMemoryInfo(handle).used // MIB
    v2 = sim.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2).used // MIB
    assert v1 == v2 + RESERVED_MIB
    assert s.memory_used_mib == v2
    assert s.memory_total_mib == 80 * 1024


class NoVersion2(ReservingNvml):
    """A library or driver without nvmlDeviceGetMemoryInfo_v2."""

    def nvmlDeviceGetMemoryInfo(self, h: object, version: int | None = None) -> object:
        if version is not None:
            self.v2_calls += 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return super().nvmlDeviceGetMemoryInfo(h)


def test_memory_falls_back_to_version_1_once_where_version_2_is_missing() -> None:
    sim = NoVersion2()
    reader = NvmlReader(sim)
    first = reader.sample(no_owner)
    second = reader.sample(no_owner)
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    v1 = sim.nvmlDeviceGetMemoryInfo(handle).used // MIB
    assert [s.memory_used_mib for s in first + second] == [v1] * 4
    assert sim.v2_calls == 1  # asked once, then never again
    assert reader.errors == 0


def sample(stamp: int, value: int) -> SimpleNamespace:
    return SimpleNamespace(timeStamp=stamp, sampleValue=SimpleNamespace(uiVal=value))


class ScriptedSamples(SimNvml):
    """NVML's utilisation buffers, as scripted: the GPU's samples and its
    processes' (all stamped in us); ``None`` for a call that raises ``fail``."""

    def __init__(self) -> None:
        super().__init__(parse_node_spec("1xH100-80GB"), hostname="x")
        self.gpu_samples: list[SimpleNamespace] | None = []
        self.proc_samples: list[SimpleNamespace] = []
        self.fail = pynvml.NVML_ERROR_NOT_FOUND
        self.asked: list[int] = []

    def nvmlDeviceGetSamples(self, h: object, kind: int, since: int) -> object:
        self.asked.append(since)
        if self.gpu_samples is None:
            raise pynvml.NVMLError(self.fail)
        new = [s for s in self.gpu_samples if s.timeStamp > since]
        if not new:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, new

    def nvmlDeviceGetComputeRunningProcesses(self, h: object) -> list[object]:
        return [
            SimpleNamespace(pid=7, usedGpuMemory=MIB),
            SimpleNamespace(pid=8, usedGpuMemory=MIB),
        ]

    def nvmlDeviceGetProcessUtilization(self, h: object, since: int) -> list[object]:
        new = [s for s in self.proc_samples if s.timeStamp > since]
        if not new:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return new


def test_utilisation_is_the_mean_of_nvmls_samples_since_the_last_read() -> None:
    """An instant reading covers NVML's last sample period only: a read a second
    would see a half-second idle gap whole or not at all."""
    sim = ScriptedSamples()
    reader = NvmlReader(sim)
    sim.gpu_samples = [sample(100, 0), sample(200, 100), sample(300, 100)]
    assert reader.sample(no_owner)[0].util_gpu == pytest.approx(200 / 3)
    sim.gpu_samples += [sample(400, 0), sample(500, 50)]
    assert reader.sample(no_owner)[0].util_gpu == 25  # only the two new ones
    assert sim.asked == [0, 300]
    # No sample since the last read: NVML's instant reading (the simulated 0).
    assert reader.sample(no_owner)[0].util_gpu == 0
    assert reader.errors == 0


def test_a_gpu_without_utilisation_samples_gives_its_instant_reading() -> None:
    sim = ScriptedSamples()
    sim.gpu_samples, sim.fail = None, pynvml.NVML_ERROR_NOT_SUPPORTED
    reader = NvmlReader(sim)
    assert [reader.sample(no_owner)[0].util_gpu for _ in range(2)] == [0, 0]
    assert sim.asked == [0]  # asked once, then never again


def test_process_utilisation_is_each_ones_mean_since_the_last_read() -> None:
    sim = ScriptedSamples()
    reader = NvmlReader(sim)
    sim.proc_samples = [
        SimpleNamespace(pid=7, smUtil=40, timeStamp=100),
        SimpleNamespace(pid=7, smUtil=60, timeStamp=200),
    ]
    first = {p.pid: p.sm_util for p in reader.sample(no_owner)[0].processes}
    # pid 8 had no sample: unknown, not 0.
    assert first == {7: 50, 8: None}
    sim.proc_samples.append(SimpleNamespace(pid=8, smUtil=90, timeStamp=300))
    assert {p.pid: p.sm_util for p in reader.sample(no_owner)[0].processes} == {
        7: None,  # its samples were read already
        8: 90,
    }
    # Nothing new (NotFound): both unknown.
    assert {p.sm_util for p in reader.sample(no_owner)[0].processes} == {None}
    assert reader.errors == 0
