"""A real Prometheus (Debian's ``prometheus``) scraping the running stack's
/metrics with the bearer token: the queue length and the GPUs' series come back
through PromQL, /metrics refuses a scrape without the token, and every PromQL
expression of the Grafana dashboard in docs/ returns data from the stack.

``GPULAB_SAVE_SCREENSHOTS=1`` also copies the screenshot of Prometheus' graph page
into docs/img/ (the admin guide shows it)."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import httpx
import pytest

from tests.browser import chromium
from tests.e2e.conftest import ROOT, Stack, free_port, wait_for_job, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from django.contrib.auth.models import User

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOKEN = "e2e-prometheus-token-0123456789"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
DASHBOARD = ROOT / "docs" / "grafana-gpulab.json"
QUEUE_LENGTH = 'sum(gpulab_jobs{state="pending"})'


@pytest.fixture(autouse=True)
def _metrics_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set before ``stack`` starts the web server, which reads it."""
    monkeypatch.setenv("GPULAB_METRICS_TOKEN", TOKEN)


@dataclass
class Prometheus:
    url: str

    def api(self, path: str, **params: str) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def health(self) -> str:
        """The gpulab target's health ("unknown" until discovered and scraped)."""
        targets = self.api("targets")["activeTargets"]
        return str(targets[0]["health"]) if targets else "unknown"


@pytest.fixture
def prometheus(stack: Stack, tmp_path: Path) -> Iterator[Prometheus]:
    """Prometheus on a free loopback port, scraping the stack every second with
    the token (from a file, as a deployment keeps it); returned once its first
    scrape of /metrics succeeded. Stopped with the stack."""
    assert os.access(PROMETHEUS, os.X_OK), (
        f"{PROMETHEUS} is missing: install Debian's prometheus (apt-get install"
        " prometheus; .ci/run does), then stop the daemon it starts"
    )
    port = free_port()
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "gpulab",
                        "metrics_path": "/metrics",
                        "authorization": {
                            "type": "Bearer",
                            "credentials_file": str(token_file),
                        },
                        "static_configs": [{"targets": [f"127.0.0.1:{stack.port}"]}],
                    }
                ],
            }
        )
    )
    proc = stack.start(
        "prometheus",
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    )
    proc.wait_for(r"Server is ready to receive web requests")
    prom = Prometheus(f"http://127.0.0.1:{port}")
    wait_until(
        lambda: prom.health() == "up",
        timeout=60,
        what="Prometheus' first successful scrape of /metrics",
    )
    yield prom


def numbers(result: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, rows' panels too."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                found.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return found


def test_a_real_prometheus_scrapes_the_stack_and_runs_the_dashboard(
    stack: Stack, prometheus: Prometheus, alice: User, tmp_path: Path
) -> None:
    from portal.quotas.models import Quota
    from scheduler import services
    from scheduler.models import Group

    # A node of two simulated GPUs, one job holding both, three waiting behind it.
    stack.start_node("prom-node", "2xA100-80GB", 2)
    Quota.objects.create(group=Group.objects.get(name="vision"), gpu_hours=100)
    running = services.submit_job(
        alice,
        services.JobRequest(
            name="long",
            command="sleep 600",
            workdir="/tmp",
            gpus=2,
            env={"GPULAB_SIM_UTIL": "77"},
        ),
    )
    assert wait_for_job(running.pk, {"running"}) == "running"
    for i in range(3):
        services.submit_job(
            alice, services.JobRequest(name=f"wait-{i}", command="true", gpus=1)
        )

    # The queue length, through PromQL, once a scrape saw the three.
    wait_until(
        lambda: numbers(prometheus.query(QUEUE_LENGTH)) == [3.0],
        timeout=60,
        what="Prometheus to see a queue of 3",
    )
    # Each GPU is one series labelled with the holder.
    held = f'gpulab_gpu_utilization_percent{{user="alice",job_id="{running.pk}"}}'
    try:
        series = wait_until(
            lambda: [r for r in prometheus.query(held) if float(r["value"][1]) == 77],
            timeout=60,
            what="both GPUs' utilisation labelled with alice's job",
        )
    except AssertionError as exc:
        seen = prometheus.query("gpulab_gpu_utilization_percent")
        raise AssertionError(f"{exc}; Prometheus has {seen}") from None
    assert sorted(r["metric"]["gpu"] for r in series) == ["0", "1"]
    assert {r["metric"]["node"] for r in series} == {"prom-node"}

    # Without the token (or with a wrong one) /metrics is refused.
    bare = httpx.get(f"{stack.base_url}/metrics")
    assert bare.status_code == 401
    assert "gpulab_jobs" not in bare.text
    wrong = httpx.get(
        f"{stack.base_url}/metrics", headers={"Authorization": "Bearer nope"}
    )
    assert wrong.status_code == 401

    # Every expression of the Grafana dashboard returns data from this stack.
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        assert "$" not in expr, f"{title}: a Grafana variable Prometheus cannot run"
        result = wait_until(
            lambda expr=expr: [
                v for v in numbers(prometheus.query(expr)) if not math.isnan(v)
            ],
            timeout=60,
            what=f"data for the panel {title!r}: {expr}",
        )
        assert result, (title, expr)

    # Prometheus' own graph page: the queue length and the GPUs' utilisation.
    shot = tmp_path / "prometheus-graph.png"
    graph = f"{prometheus.url}/graph?" + urlencode(
        {
            "g0.expr": QUEUE_LENGTH,
            "g0.tab": "0",
            "g0.range_input": "1m",
            "g1.expr": "gpulab_gpu_utilization_percent",
            "g1.tab": "0",
            "g1.range_input": "1m",
        }
    )
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(graph)
        # Debian's Prometheus has the classic UI: Rickshaw draws an SVG per graph.
        page.wait_for_function(
            "[...document.querySelectorAll('.rickshaw_graph')]"
            ".filter(g => g.querySelector('svg path')).length >= 2"
        )
        legend = page.inner_text("body")
        assert 'user="alice"' in legend
        assert f'job_id="{running.pk}"' in legend
        page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("GPULAB_SAVE_SCREENSHOTS") == "1":
        shutil.copy(shot, ROOT / "docs" / "img" / "prometheus-graph.png")
