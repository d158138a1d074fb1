"""/metrics: the collector's figures against hand-built database and Redis state
(exact numbers), and the access rules (off by default, bearer token, address
allow-list)."""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from django.utils import timezone
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from agents import protocol
from portal.prometheus.collector import MIB, GpulabCollector
from portal.quotas.models import Quota
from scheduler import ingest, pass_log, services
from scheduler.live.hub import Hub, clients_key
from scheduler.models import Gpu, Job, Node, UsageRecord
from scheduler.pass_requests import _redis_client
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from datetime import datetime

    from django.contrib.auth.models import User
    from pytest_django.fixtures import SettingsWrapper

pytestmark = pytest.mark.django_db

TOKEN = "s3cret-token-for-prometheus"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(autouse=True)
def _fresh_redis() -> None:
    """No pass statistics, ingest count, readings or browser counts of another
    test of this run."""
    client = _redis_client()
    for pattern in ("passes:*", "ingest:*", "live:*"):
        keys = list(client.scan_iter(match=f"{settings.REDIS_PREFIX}:{pattern}"))
        if keys:
            client.delete(*keys)


def scrape(now: datetime | None = None) -> Samples:
    """Every sample the collector yields, by name and labels."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpulabCollector(now=now))
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


# ------------------------------------------------------------------ jobs


def test_jobs_by_state_class_and_reason_and_the_longest_wait(
    alice: User, charlie: User
) -> None:
    now = timezone.now()
    for minutes, reason in ((10, "resources"), (4, "resources"), (1, "")):
        JobFactory(
            owner=alice,
            pending_reason=reason,
            submitted_at=now - timedelta(minutes=minutes),
        )
    JobFactory(owner=charlie, priority_class="high", pending_reason="quota")
    JobFactory(owner=charlie, status=Job.Status.HELD, pending_reason="held")
    JobFactory(owner=alice, status=Job.Status.COMPLETED, priority_class="high")

    s = scrape(now)

    assert value(s, "gpulab_jobs", state="pending", **{"class": "normal"}) == 3
    assert value(s, "gpulab_jobs", state="pending", **{"class": "high"}) == 1
    assert value(s, "gpulab_jobs", state="held", **{"class": "normal"}) == 1
    assert value(s, "gpulab_jobs", state="completed", **{"class": "high"}) == 1
    # Every state and class is written, zeros included (9 states x 4 classes).
    assert len(series(s, "gpulab_jobs")) == 36
    assert value(s, "gpulab_jobs", state="running", **{"class": "best-effort"}) == 0
    # Waiting: pending jobs only (the held job is counted as held, not here).
    assert value(s, "gpulab_jobs_waiting", reason="resources") == 2
    assert value(s, "gpulab_jobs_waiting", reason="quota") == 1
    assert value(s, "gpulab_jobs_waiting", reason="unassessed") == 1
    assert value(s, "gpulab_jobs_waiting", reason="held") == 0
    assert value(s, "gpulab_queue_longest_wait_seconds") == 600.0


def test_starts_and_preemptions_count_attempts_and_the_jobs_preemptions(
    alice: User,
) -> None:
    node, _ = make_node("node-a", 4)
    first, second = JobFactory(owner=alice), JobFactory(owner=alice)
    low = JobFactory(owner=alice, priority_class="best-effort")
    start_job(first, node)
    start_job(second, node)
    start_job(low, node)
    Job.objects.filter(pk=low.pk).update(preemptions=3)

    s = scrape()

    assert value(s, "gpulab_job_starts_total", **{"class": "normal"}) == 2
    assert value(s, "gpulab_job_starts_total", **{"class": "best-effort"}) == 1
    assert value(s, "gpulab_job_starts_total", **{"class": "high"}) == 0
    assert value(s, "gpulab_preemptions_total", **{"class": "best-effort"}) == 3
    assert value(s, "gpulab_preemptions_total", **{"class": "normal"}) == 0
    assert value(s, "gpulab_queue_longest_wait_seconds") == 0.0
    assert value(s, "gpulab_jobs", state="starting", **{"class": "normal"}) == 2


# ------------------------------------------------------------------ passes


def _record(at: float, total_s: float, started: int) -> pass_log.PassRecord:
    return pass_log.PassRecord(
        at=at,
        considered=7,
        started=started,
        preempted=1,
        reserved=0,
        backfilled=2,
        stop_reason=pass_log.QUEUE_EXHAUSTED,
        load_s=total_s / 2,
        decide_s=total_s / 4,
        apply_s=total_s / 4,
        total_s=total_s,
        stage_s={"ordering": 0.001},
    )


def test_the_pass_histogram_and_the_last_pass() -> None:
    pass_log.keep(_record(1000.0, 0.003, started=1))
    pass_log.keep(_record(2000.0, 0.3, started=4))

    s = scrape()

    bucket = "gpulab_pass_duration_seconds_bucket"
    assert value(s, bucket, le="0.005") == 1
    assert value(s, bucket, le="0.25") == 1
    assert value(s, bucket, le="0.5") == 2
    assert value(s, bucket, le="+Inf") == 2
    assert value(s, "gpulab_pass_duration_seconds_count") == 2
    assert value(s, "gpulab_pass_duration_seconds_sum") == pytest.approx(0.303)
    assert value(s, "gpulab_passes_total", stop_reason="queue exhausted") == 2
    # The last pass is the newer one.
    assert value(s, "gpulab_last_pass_jobs", what="started") == 4
    assert value(s, "gpulab_last_pass_jobs", what="backfilled") == 2
    assert value(s, "gpulab_last_pass_seconds", stage="total") == 0.3
    assert value(s, "gpulab_last_pass_seconds", stage="load") == 0.15
    assert value(s, "gpulab_last_pass_seconds", stage="policy:ordering") == 0.001
    assert value(s, "gpulab_last_pass_timestamp_seconds") == 2000.0


def test_no_pass_yet_gives_an_empty_histogram() -> None:
    s = scrape()
    assert value(s, "gpulab_pass_duration_seconds_count") == 0
    assert not series(s, "gpulab_last_pass_jobs")


# ------------------------------------------------------------------ cluster


def _reading(index: int, util: float, mem: int, power: float, temp: float) -> Any:
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "util_gpu": util,
        "memory_used_mib": mem,
        "power_w": power,
        "temperature_c": temp,
    }


def test_each_gpu_is_one_series_labelled_with_its_holder(
    alice: User, bob: User
) -> None:
    now = timezone.now()
    node, _ = make_node("node-a", 3)
    lost, _ = make_node("node-b", 2)
    Node.objects.filter(pk=node.pk).update(connected=True)
    Node.objects.filter(pk=lost.pk).update(
        status=Node.Status.LOST, draining=True, connected=False
    )
    gpus = list(node.gpus.order_by("index"))
    readings = [(87.0, 1000, 250.0, 61.0), (0.0, 0, 60.0, 35.0), (50.0, 10, 1, 40)]
    for gpu, (util, mem, power, temp) in zip(gpus, readings, strict=True):
        Gpu.objects.filter(pk=gpu.pk).update(
            latest=_reading(gpu.index, util, mem, power, temp),
            latest_at=now - timedelta(seconds=2),
        )
    # GPU 2's reading is older than the live view's 15 s: no series for it.
    Gpu.objects.filter(pk=gpus[2].pk).update(latest_at=now - timedelta(minutes=5))
    job = JobFactory(owner=alice)
    start_job(job, node, [gpus[0]])

    s = scrape(now)

    util = series(s, "gpulab_gpu_utilization_percent")
    assert util == {
        frozenset(
            {
                "node": "node-a",
                "gpu": "0",
                "user": "alice",
                "job_id": str(job.pk),
            }.items()
        ): 87.0,
        frozenset(
            {"node": "node-a", "gpu": "1", "user": "", "job_id": ""}.items()
        ): 0.0,
    }
    labels = {"node": "node-a", "gpu": "0", "user": "alice", "job_id": str(job.pk)}
    assert value(s, "gpulab_gpu_memory_used_bytes", **labels) == 1000 * MIB
    assert value(s, "gpulab_gpu_power_watts", **labels) == 250.0
    assert value(s, "gpulab_gpu_temperature_celsius", **labels) == 61.0
    assert value(s, "gpulab_gpus", state="busy") == 1
    assert value(s, "gpulab_gpus", state="free") == 2
    assert value(s, "gpulab_gpus", state="unavailable") == 2  # node-b is lost
    assert value(s, "gpulab_gpus", state="shared") == 0
    assert value(s, "gpulab_nodes", status="up", mode="none") == 1
    assert value(s, "gpulab_nodes", status="lost", mode="draining") == 1
    assert value(s, "gpulab_nodes", status="new", mode="maintenance") == 0
    assert value(s, "gpulab_websocket_clients", kind="agent") == 1
    assert value(s, "gpulab_node_metrics_age_seconds", node="node-a") == 2.0


def test_a_finished_jobs_series_ends_and_the_gpu_goes_on_unlabelled(
    alice: User,
) -> None:
    node, _ = make_node("node-a", 1)
    Node.objects.filter(pk=node.pk).update(connected=True)
    gpu = node.gpus.get()
    Gpu.objects.filter(pk=gpu.pk).update(
        latest=_reading(0, 90.0, 5, 100.0, 50.0), latest_at=timezone.now()
    )
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)
    busy = series(scrape(), "gpulab_gpu_utilization_percent")
    assert [dict(labels)["job_id"] for labels in busy] == [str(job.pk)]

    services.mark_started(node.pk, started_data(attempt))
    services.finish_attempt(node.pk, exited_data(attempt, 0))

    free = series(scrape(), "gpulab_gpu_utilization_percent")
    assert [dict(labels) for labels in free] == [
        {"node": "node-a", "gpu": "0", "user": "", "job_id": ""}
    ]


def test_a_shared_gpu_stays_one_series_with_both_holders(
    alice: User, bob: User
) -> None:
    node, _ = make_node("node-a", 1)
    Node.objects.filter(pk=node.pk).update(connected=True)
    gpu = node.gpus.get()
    Gpu.objects.filter(pk=gpu.pk).update(
        latest=_reading(0, 40.0, 5, 100.0, 50.0), latest_at=timezone.now()
    )
    # Two live allocations on the GPU, each its own slot (as co-location makes).
    first = JobFactory(owner=bob, shareable=True)
    second = JobFactory(owner=alice, shareable=True)
    _share(node, gpu, [first, second])

    s = scrape()

    util = series(s, "gpulab_gpu_utilization_percent")
    assert list(util.values()) == [40.0]
    (labels,) = util
    assert dict(labels)["user"] == "bob,alice"
    assert dict(labels)["job_id"] == f"{first.pk},{second.pk}"
    assert value(s, "gpulab_gpus", state="shared") == 1


def _share(node: Node, gpu: Gpu, jobs: list[Job]) -> None:
    from scheduler import policy
    from tests.factories import shared_start

    services.apply_decisions([policy.Start.on(jobs[0].pk, node.pk, (gpu.pk,))])
    services.apply_decisions([shared_start(jobs[1], gpu.pk, node.pk, (jobs[0].pk,))])


# ------------------------------------------------------------------ charges


def test_gpu_hours_per_group_and_quota_use(alice: User, charlie: User) -> None:
    now = timezone.now()
    node, _ = make_node("node-a", 2)
    gpu = node.gpus.order_by("index").first()
    assert gpu is not None
    job = JobFactory(owner=alice)
    for seconds in (5400.0, 1800.0):
        UsageRecord.objects.create(
            attempt=start_job(JobFactory(owner=alice), node),
            gpu=gpu,
            user=alice,
            group=job.group,
            started_at=now - timedelta(hours=3),
            ended_at=now - timedelta(hours=1),
            share=1.0,
            gpu_seconds=seconds,
        )
    Quota.objects.create(group=job.group, gpu_hours=10, hard=True)

    s = scrape(now)

    assert value(s, "gpulab_group_gpu_hours_total", group="vision") == 2.0
    assert value(s, "gpulab_group_gpu_hours_total", group="nlp") == 0.0
    (labels,) = series(s, "gpulab_quota_used_gpu_hours")
    assert dict(labels)["group"] == "vision"
    assert dict(labels)["kind"] == "hard"
    assert series(s, "gpulab_quota_used_gpu_hours")[labels] == 2.0
    assert series(s, "gpulab_quota_limit_gpu_hours")[labels] == 10.0
    assert series(s, "gpulab_quota_running_gpus")[labels] == 2


# ------------------------------------------------------------------ ingest, clients


def test_ingested_frames_are_counted_for_every_process(alice: User) -> None:
    node, _ = make_node("node-a", 2)
    frame = protocol.MetricsData(
        sampled_at=timezone.now().timestamp(),
        gpus=[protocol.GpuSample(index=i, uuid=f"u{i}", util_gpu=1) for i in (0, 1)],
    )
    for _ in range(3):
        assert (
            ingest._write([services.MetricsFrame(node.pk, frame, persist=False)]) == {}
        )

    assert value(scrape(), "gpulab_ingest_frames_total") == 3


class _Page:
    async def rejoin(self, *, lost: bool) -> None:
        return None


def test_browsers_are_counted_over_processes() -> None:
    pages = [_Page(), _Page()]

    async def report() -> None:
        hub = Hub()
        for page in pages:
            hub.add_member(page)
        await hub.report_clients()
        # Another process's entry that expired (the process died): left out.
        await hub.redis.hset(clients_key(), "dead-process", "7 1.0")
        await hub.redis.aclose()

    async_to_sync(report)()

    assert value(scrape(), "gpulab_websocket_clients", kind="browser") == 2


# ------------------------------------------------------------------ access


def test_off_by_default_with_a_body_naming_the_settings(
    settings: SettingsWrapper,
) -> None:
    settings.GPULAB_METRICS_TOKEN = ""
    settings.GPULAB_METRICS_ALLOWED_NETWORKS = ()
    response = Client().get("/metrics")
    assert response.status_code == 404
    body = response.content.decode()
    assert "GPULAB_METRICS_TOKEN" in body
    assert "GPULAB_METRICS_ALLOWED_NETWORKS" in body


def test_the_token_is_required_when_set(settings: SettingsWrapper) -> None:
    settings.GPULAB_METRICS_TOKEN = TOKEN
    settings.GPULAB_METRICS_ALLOWED_NETWORKS = ()
    client = Client()
    for header in ("", "Bearer wrong-token", f"Basic {TOKEN}", "Bearer"):
        extra = {"HTTP_AUTHORIZATION": header} if header else {}
        response = client.get("/metrics", **extra)
        assert response.status_code == 401, header
        assert response["WWW-Authenticate"].startswith("Bearer")
        assert b"gpulab_jobs" not in response.content
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"# TYPE gpulab_jobs gauge" in response.content
    assert (
        client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405
    )


def test_the_address_allow_list(settings: SettingsWrapper) -> None:
    from ipaddress import ip_network

    settings.GPULAB_METRICS_TOKEN = ""
    settings.GPULAB_METRICS_ALLOWED_NETWORKS = (ip_network("10.1.0.0/16"),)
    inside = Client(REMOTE_ADDR="10.1.2.3").get("/metrics")
    outside = Client(REMOTE_ADDR="10.2.0.1").get("/metrics")
    assert inside.status_code == 200
    assert outside.status_code == 403
    assert "GPULAB_METRICS_ALLOWED_NETWORKS" in outside.content.decode()
    # Both set: both are needed.
    settings.GPULAB_METRICS_TOKEN = TOKEN
    assert Client(REMOTE_ADDR="10.1.2.3").get("/metrics").status_code == 401
    ok = Client(REMOTE_ADDR="10.1.2.3").get(
        "/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}"
    )
    assert ok.status_code == 200
    refused = Client(REMOTE_ADDR="10.2.0.1").get(
        "/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}"
    )
    assert refused.status_code == 403


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"GPULAB_METRICS_TOKEN": "short"}, "at least 16 characters"),
        ({"GPULAB_METRICS_TOKEN": "a token with spaces in it"}, "white space"),
        ({"GPULAB_METRICS_ALLOWED_NETWORKS": "10.0.0.0/8, prom"}, "'prom'"),
    ],
)
def test_bad_settings_stop_the_start_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    import portal.settings_metrics as module

    for name, text in env.items():
        monkeypatch.setenv(name, text)
    with pytest.raises(ImproperlyConfigured, match=named) as raised:
        importlib.reload(module)
    assert "GPULAB_METRICS_" in str(raised.value)
    monkeypatch.undo()
    importlib.reload(module)
