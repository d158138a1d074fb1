"""Command line: token handling, server URL, missing driver."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from agent_helpers import ROOT

from agents.main import ConfigError, main, read_token, server_url

if TYPE_CHECKING:
    from pathlib import Path


def test_server_url_gets_the_agent_path() -> None:
    assert server_url("ws://h:8000") == "ws://h:8000/ws/agent/"
    assert server_url("ws://h:8000/") == "ws://h:8000/ws/agent/"
    assert server_url("wss://h/custom/") == "wss://h/custom/"
    with pytest.raises(ConfigError):
        server_url("http://h:8000")


def test_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t"
    f.write_text("  abc \n")
    assert read_token(str(f)) == "abc"
    monkeypatch.setenv("GPULAB_AGENT_TOKEN", "from-env")
    assert read_token(None) == "from-env"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_token(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="cannot read the token file"):
        read_token(str(tmp_path / "missing"))
    monkeypatch.delenv("GPULAB_AGENT_TOKEN")
    with pytest.raises(ConfigError, match="no agent token"):
        read_token(None)


def run_cli(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agents", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        check=False,
    )


def test_missing_token_exits_2(tmp_path: Path) -> None:
    res = run_cli("--server", "ws://127.0.0.1:1", "--state-dir", str(tmp_path))
    assert res.returncode == 2
    assert "no agent token" in res.stderr
    assert "Traceback" not in res.stderr


def _driver_present() -> bool:
    import pynvml

    from agents.nvml import NvmlReader, NvmlUnavailable

    try:
        NvmlReader(pynvml).close()
    except NvmlUnavailable:
        return False
    return True  # pragma: no cover - a machine with a driver


@pytest.mark.skipif(_driver_present(), reason="this machine has an NVIDIA driver")
def test_no_driver_without_simulate_exits_2(tmp_path: Path) -> None:
    res = run_cli(
        "--server",
        "ws://127.0.0.1:1",
        "--state-dir",
        str(tmp_path),
        env={"GPULAB_AGENT_TOKEN": "s3cret"},
    )
    assert res.returncode == 2
    assert "no NVIDIA driver found on this machine" in res.stderr
    assert "--simulate SPEC" in res.stderr
    assert "s3cret" not in res.stderr


def test_bad_simulate_spec_exits_2(tmp_path: Path) -> None:
    code = main(
        [
            "--server",
            "ws://h:1",
            "--token-file",
            __file__,
            "--simulate",
            "4xWHAT",
            "--state-dir",
            str(tmp_path),
        ]
    )
    assert code == 2


@pytest.mark.parametrize(
    "flags",
    [
        ["--spool-max-mb", "0"],
        ["--spool-metrics-interval", "-1"],
        ["--kill-after-disconnect", "0"],
    ],
)
def test_bad_limits_exit_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, flags: list[str]
) -> None:
    args = ["--server", "ws://h:1", "--token-file", __file__, "--simulate", "1xA100"]
    code = main([*args, "--state-dir", str(tmp_path), *flags])
    assert code == 2
    assert flags[0] in caplog.text
