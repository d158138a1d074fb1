"""Topology in hello, simulation files (GPUs + scheduled faults), their errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
from agent_helpers import ROOT, Portal, await_until

from agents.nvml import NvmlReader
from agents.simulate import SimNvml, load_sim_file, load_simulation
from agents.spec import SpecError, parse_node_spec

if TYPE_CHECKING:
    from pathlib import Path


def no_owner(_pid: int) -> None:
    return None


def levels(reader: NvmlReader, index: int) -> dict[int, int]:
    return {t.peer: t.level for t in reader.gpus()[index].topology}


def test_topology_levels_are_deterministic() -> None:
    reader = NvmlReader(SimNvml(parse_node_spec("8xH100-80GB:nvlink"), hostname="h"))
    assert levels(reader, 0) == {1: 10, 2: 20, 3: 20, 4: 50, 5: 50, 6: 50, 7: 50}
    assert levels(reader, 5) == {4: 10, 6: 20, 7: 20, 0: 50, 1: 50, 2: 50, 3: 50}
    # Symmetric, and NVLink stays in nvlink_peers.
    for g in reader.gpus():
        for link in g.topology:
            assert levels(reader, link.peer)[g.index] == link.level
    assert reader.gpus()[0].nvlink_peers == [1, 2, 3, 4, 5, 6, 7]
    reader16 = NvmlReader(SimNvml(parse_node_spec("16xA100-80GB"), hostname="h"))
    assert levels(reader16, 0)[4] == 40  # same half of the node: same NUMA node
    assert levels(reader16, 0)[8] == 50


def test_topology_unsupported_or_single_gpu_is_empty() -> None:
    sim = SimNvml(parse_node_spec("2xA100-80GB"), hostname="h")
    sim.unsupported.add("nvmlDeviceGetTopologyCommonAncestor")
    assert [g.topology for g in NvmlReader(sim).gpus()] == [[], []]
    one = NvmlReader(SimNvml(parse_node_spec("1xA100-80GB"), hostname="h"))
    assert one.gpus()[0].topology == []


def test_lost_peer_is_left_out_of_topology() -> None:
    sim = SimNvml(parse_node_spec("4xA100-80GB"), hostname="h")
    sim.lost.add(2)
    reader = NvmlReader(sim)
    assert levels(reader, 0) == {1: 10, 3: 20}
    assert reader.gpus()[2].topology == []


FILE: dict[str, Any] = {
    "gpus": {"count": 4, "model": "A100", "memory_gb": 80},
    "nvlink": True,
    "faults": {
        "gpu_lost": [{"index": 1, "at": 30}],
        "ecc_errors": [{"index": 0, "at": 10, "count": 3}, {"index": 0, "at": 20}],
        "unsupported": ["nvmlDeviceGetTotalEnergyConsumption"],
    },
}


def test_json_file_with_scheduled_faults(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    path.write_text(json.dumps(FILE))
    spec, faults = load_simulation(str(path))
    assert (spec.gpus, spec.model, spec.memory_mib, spec.nvlink) == (
        4,
        "A100",
        80 * 1024,
        True,
    )
    now = [1000.0]
    reader = NvmlReader(
        SimNvml(spec, hostname="h", clock=lambda: now[0], faults=faults)
    )
    assert reader.gpus()[1].nvlink_peers == [0, 2, 3]
    s = reader.sample(no_owner)
    assert [g.lost for g in s] == [False] * 4
    assert s[0].ecc_uncorrected == 0
    assert all(g.energy_mj is None for g in s)  # unsupported: absent, not 0
    assert s[0].power_w is not None
    now[0] += 10
    assert reader.sample(no_owner)[0].ecc_uncorrected == 3
    now[0] += 10
    assert reader.sample(no_owner)[0].ecc_uncorrected == 4
    now[0] += 10  # 30 s after start: GPU 1 falls off the bus
    s = reader.sample(no_owner)
    assert [g.lost for g in s] == [False, True, False, False]
    assert s[1].uuid == reader.uuids[1]
    assert s[1].memory_used_mib is None


# PyYAML is optional (not a dependency of the agent): JSON always works.
needs_yaml = pytest.mark.skipif(
    importlib.util.find_spec("yaml") is None, reason="PyYAML is not installed"
)


@needs_yaml
def test_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(
        "gpus:\n  count: 2\n  model: H100-80GB\n"
        "faults:\n  gpu_lost:\n    - {index: 0, at: 0}\n"
    )
    spec, faults = load_sim_file(path)
    assert (spec.gpus, spec.memory_mib, spec.nvlink) == (2, 80 * 1024, False)
    reader = NvmlReader(SimNvml(spec, hostname="h", faults=faults))
    assert [g.lost for g in reader.sample(no_owner)] == [True, False]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "expected a mapping"),
        ('{"gpus": {"model": "A100"}}', "gpus.count: Field required"),
        ('{"gpus": {"count": 2, "model": "A100"}, "color": 1}', "color: Extra inputs"),
        ('{"gpus": {"count": 2, "model": "ZZ9"}}', "unknown GPU model 'ZZ9'"),
        (
            '{"gpus": {"count": 2, "model": "A100"},'
            ' "faults": {"gpu_lost": [{"index": 2, "at": 1}]}}',
            "faults.gpu_lost.0.index: GPU 2 does not exist",
        ),
        (
            '{"gpus": {"count": 2, "model": "A100"},'
            ' "faults": {"ecc_errors": [{"index": 0, "at": -1}]}}',
            "faults.ecc_errors.0.at",
        ),
        (
            '{"gpus": {"count": 2, "model": "A100"},'
            ' "faults": {"unsupported": ["nvmlDeviceGetWhatever"]}}',
            "'nvmlDeviceGetWhatever' is not an NVML function",
        ),
    ],
)
def test_bad_file_names_the_problem(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "node.json"
    path.write_text(content)
    with pytest.raises(SpecError) as info:
        load_sim_file(path)
    assert expected in str(info.value)
    assert str(path) in str(info.value)


def test_yaml_without_pyyaml_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("gpus: {count: 1, model: A100}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml -> ImportError
    with pytest.raises(SpecError, match="reading YAML needs PyYAML"):
        load_sim_file(path)


@needs_yaml
def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "n.yml"
    bad.write_text("gpus: [unclosed\n")
    with pytest.raises(SpecError, match="is not valid YAML"):
        load_sim_file(bad)
    with pytest.raises(SpecError, match="cannot read"):
        load_simulation(str(tmp_path / "missing.json"))


def test_cli_bad_file_exits_2_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    path.write_text('{"gpus": {"count": 0, "model": "A100"}}')
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "agents",
            "--server",
            "ws://127.0.0.1:1",
            "--simulate",
            str(path),
            "--state-dir",
            str(tmp_path / "s"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
        env={"PATH": "/usr/bin:/bin", "GPULAB_AGENT_TOKEN": "t"},
        check=False,
    )
    assert res.returncode == 2
    assert "--simulate" in res.stderr
    assert "gpus.count: Input should be greater than or equal to 1" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.anyio
async def test_agent_started_with_a_file_reports_topology_and_the_lost_gpu(
    portal: Portal, tmp_path: Path
) -> None:
    path = tmp_path / "node.json"
    path.write_text(
        json.dumps(
            {
                "gpus": {"count": 4, "model": "A100-80GB"},
                "faults": {
                    "gpu_lost": [{"index": 1, "at": 1}],
                    "ecc_errors": [{"index": 0, "at": 0, "count": 2}],
                },
            }
        )
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents",
            "--server",
            portal.url,
            "--simulate",
            str(path),
            "--state-dir",
            str(tmp_path / "state"),
            "--sample-interval",
            "0.2",
        ],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "GPULAB_AGENT_TOKEN": "t"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        hello = (await await_until(lambda: portal.of("hello"), 15))[0]["data"]
        gpu0 = hello["gpus"][0]
        assert gpu0["topology"] == [
            {"peer": 1, "level": 10},
            {"peer": 2, "level": 20},
            {"peer": 3, "level": 20},
        ]

        def lost_sample() -> Any:
            for m in portal.of("metrics"):
                if m["data"]["gpus"][1]["lost"]:
                    return m["data"]["gpus"]
            return None

        gpus = await await_until(lost_sample, 15)
        assert [g["lost"] for g in gpus] == [False, True, False, False]
        assert gpus[0]["ecc_uncorrected"] == 2
    finally:
        proc.terminate()
        proc.wait(10)
