"""The real NVML backend on a real GPU: ``pytest -m gpu`` on a machine with a driver.

Deselected by default (``-m 'not gpu'``); on a machine without a driver they fail
(never skip), so a GPU run that passes really read a GPU.
"""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING

import pynvml
import pytest

from agents.nvml import NvmlReader

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.gpu


@pytest.fixture
def reader() -> Iterator[NvmlReader]:
    real = NvmlReader(pynvml)
    yield real
    real.close()


def test_real_nvml_initialises_and_lists_gpus(reader: NvmlReader) -> None:
    gpus = reader.gpus()
    assert len(gpus) >= 1
    for gpu in gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert gpu.memory_total_mib > 1
        assert gpu.name != "unknown GPU"
        assert all(link.peer != gpu.index for link in gpu.topology)
    assert reader.driver_version


def test_real_nvml_samples(reader: NvmlReader) -> None:
    samples = reader.sample(lambda _pid: None)
    assert [s.index for s in samples] == [g.index for g in reader.gpus()]
    for s in samples:
        assert not s.lost
        assert s.uuid == reader.uuids[s.index]
        assert s.memory_total_mib and s.memory_used_mib is not None
        assert s.memory_used_mib <= s.memory_total_mib
        assert s.util_gpu is None or 0 <= s.util_gpu <= 100


def test_real_nvml_memory_used_is_what_nvidia_smi_shows(reader: NvmlReader) -> None:
    """nvidia-smi leaves out the memory the driver reserves; so must the agent
    (NVML's version 1 call counts it as used: 614 MiB more on an H200)."""

    def smi() -> list[int]:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [int(v) for v in out.split()]

    before = smi()
    samples = reader.sample(lambda _pid: None)
    after = smi()
    for s, low, high in zip(samples, before, after, strict=True):
        assert s.memory_used_mib is not None
        tolerance = max(16, 0.01 * max(low, high))
        assert min(low, high) - tolerance <= s.memory_used_mib
        assert s.memory_used_mib <= max(low, high) + tolerance
