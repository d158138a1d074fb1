"""The collector behind ``/metrics``: every figure read at scrape time.

Nothing is counted in the web process: jobs, attempts, nodes and charges come
from PostgreSQL, the passes' statistics, the nodes' newest readings, the ingest
counter and the browsers' counts from Redis, so two web processes scraped at
the same moment give the same answer. The queries are a fixed number whatever
the cluster's size (fourteen): one scan of the jobs, the pending jobs by reason,
the cluster's read model (``livestate.cluster_state``, three), the GPU-hours per
group (three: ``portal.prometheus.ledger`` folds the new usage deltas and reads
one total per group, never the whole ledger), the quotas' states (three), the
nodes' ingest lag.

Counters (``*_total``) are totals the database keeps (the jobs' attempt and
preemption counts, the usage records' GPU-seconds, the pass totals), so they
only grow; series that could be absent are written as zeros (every job
state and class, every waiting reason, every GPU and node state), so a PromQL
sum over them is never an empty result.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings
from django.db.models import Count, Max, Min, Sum
from django.utils import timezone
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from portal.prometheus import ledger
from portal.quotas.usage import quota_states
from scheduler import livestate, pass_log
from scheduler.ingest import frames_key
from scheduler.live.hub import clients_key
from scheduler.models import Job, Node
from scheduler.pass_requests import _redis_client
from scheduler.policy import Reason

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from datetime import datetime

    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

GPU_STATES = ("free", "busy", "shared", "unavailable")
NODE_MODES = ("none", "draining", "maintenance")
# A waiting job no pass has looked at yet has no stored reason.
UNASSESSED = "unassessed"
MIB = 1024 * 1024


def classes() -> list[str]:
    """The configured priority classes (labels written even at zero)."""
    return list(settings.GPULAB_PRIORITY_CLASSES)


class GpulabCollector(Collector):
    """Yields every gpulab metric family; ``now`` fixes the clock (tests)."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        now = self.now or timezone.now()
        yield from jobs(now)
        yield from passes()
        yield from cluster(now)
        yield from charges(now)
        yield from ingest(now)
        took = GaugeMetricFamily(
            "gpulab_scrape_duration_seconds",
            "Time this web process took to read the figures of this scrape.",
        )
        took.add_metric([], time.perf_counter() - started)
        yield took


# ------------------------------------------------------------------ jobs


def jobs(now: datetime) -> Iterator[Metric]:
    """Jobs by state and class, the starts (``Job.attempts``) and preemptions
    (``Job.preemptions``) counters by class, all from one scan of the jobs;
    waiting jobs by reason and the longest wait from the pending jobs' index."""
    names = classes()
    counts = {(s, c): 0 for s in Job.Status.values for c in names}
    made = dict.fromkeys(names, 0)
    preempted = dict.fromkeys(names, 0)
    rows = Job.objects.order_by().values_list("status", "priority_class")
    for status, klass, n, attempts, preemptions in rows.annotate(
        n=Count("id"), attempts=Sum("attempts"), preemptions=Sum("preemptions")
    ):
        counts[(status, klass)] = n
        made[klass] = made.get(klass, 0) + attempts
        preempted[klass] = preempted.get(klass, 0) + preemptions
    by_state = GaugeMetricFamily(
        "gpulab_jobs", "Jobs by state and priority class.", labels=["state", "class"]
    )
    for (status, klass), n in sorted(counts.items()):
        by_state.add_metric([status, klass], n)
    yield by_state

    waiting = GaugeMetricFamily(
        "gpulab_jobs_waiting",
        "Pending jobs by the reason the last pass gave ('unassessed': no pass has"
        " looked at the job yet).",
        labels=["reason"],
    )
    reasons = dict.fromkeys([*(r.value for r in Reason), UNASSESSED], 0)
    oldest: datetime | None = None
    pending = Job.objects.filter(status=Job.Status.PENDING).order_by()
    for reason, n, first in pending.values_list("pending_reason").annotate(
        n=Count("id"), first=Min("submitted_at")
    ):
        key = reason or UNASSESSED
        reasons[key] = reasons.get(key, 0) + n
        oldest = first if oldest is None else min(oldest, first)
    for reason, n in reasons.items():
        waiting.add_metric([reason], n)
    yield waiting

    longest = GaugeMetricFamily(
        "gpulab_queue_longest_wait_seconds",
        "How long the longest-waiting pending job has waited since it was"
        " submitted (0: none waits).",
    )
    longest.add_metric(
        [], max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0
    )
    yield longest

    starts = CounterMetricFamily(
        "gpulab_job_starts",
        "Job starts (attempts made, a multi-node job's once) by priority class.",
        labels=["class"],
    )
    for klass, n in made.items():
        starts.add_metric([klass], n)
    yield starts
    preemptions = CounterMetricFamily(
        "gpulab_preemptions",
        "Preemptions of running jobs by the preempted job's priority class.",
        labels=["class"],
    )
    for klass, n in preempted.items():
        preemptions.add_metric([klass], n)
    yield preemptions


# ------------------------------------------------------------------ passes


def passes() -> Iterator[Metric]:
    """The pass-duration histogram and pass counts (``pass_log.totals``) and the
    last pass's statistics (``pass_log.recent``)."""
    totals = pass_log.totals()
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for bound in pass_log.DURATION_BUCKETS:
        cumulative += totals.durations.get(repr(bound), 0)
        buckets.append((repr(bound), cumulative))
    buckets.append(("+Inf", totals.passes))
    yield HistogramMetricFamily(
        "gpulab_pass_duration_seconds",
        "Scheduling passes' durations (load, decide, apply).",
        buckets=buckets,
        sum_value=totals.total_s,
    )
    stops = CounterMetricFamily(
        "gpulab_passes",
        "Scheduling passes by why they stopped ('queue exhausted': every waiting"
        " job was looked at).",
        labels=["stop_reason"],
    )
    for reason, n in {pass_log.QUEUE_EXHAUSTED: 0, **totals.stops}.items():
        stops.add_metric([reason], n)
    yield stops

    last = next(iter(pass_log.recent(1)), None)
    figures = GaugeMetricFamily(
        "gpulab_last_pass_jobs",
        "The last pass's jobs: considered, started, preempted, reserved, backfilled.",
        labels=["what"],
    )
    seconds = GaugeMetricFamily(
        "gpulab_last_pass_seconds",
        "Where the last pass's time went: load, decide, apply, total, and the"
        " policy's stages (stage label).",
        labels=["stage"],
    )
    at = GaugeMetricFamily(
        "gpulab_last_pass_timestamp_seconds", "When the last pass ran (Unix time)."
    )
    if last is not None:
        for name in pass_log.COUNTS:
            figures.add_metric([name], getattr(last, name))
        for name in ("load", "decide", "apply", "total"):
            seconds.add_metric([name], getattr(last, f"{name}_s"))
        for stage, took in last.stage_s.items():
            seconds.add_metric([f"policy:{stage}"], took)
        at.add_metric([], last.at)
    yield figures
    yield seconds
    yield at


# ------------------------------------------------------------------ cluster


def _readings() -> dict[int, dict[str, Any]]:
    """The nodes' newest readings as the live path keeps them in Redis (fresher
    than the database's latest state while it catches up)."""
    key = f"{settings.REDIS_PREFIX}:live:readings"
    raw = cast("dict[bytes, bytes]", _redis_client().hgetall(key))
    return {int(k): json.loads(v) for k, v in raw.items()}


def _holder_labels(gpu: Any) -> tuple[str, str]:
    """The user(s) and job id(s) holding a GPU, in job order; two jobs sharing
    it are written ``a,b`` so that a GPU stays one series."""
    held = sorted(gpu["jobs"], key=lambda j: j["id"])
    return (
        ",".join(str(j["owner"]) for j in held),
        ",".join(str(j["id"]) for j in held),
    )


def cluster(now: datetime) -> Iterator[Metric]:
    """Nodes and GPUs by state, and each GPU's newest readings labelled with its
    holder (from ``livestate.cluster_state``, the dashboards' read model)."""
    state = livestate.cluster_state(
        headline=False, now=now.timestamp(), readings=_readings()
    )
    nodes = GaugeMetricFamily(
        "gpulab_nodes", "Nodes by state and mode.", labels=["status", "mode"]
    )
    node_counts = {(s, m): 0 for s in Node.Status.values for m in NODE_MODES}
    agents = 0
    for node in state["nodes"]:
        node_counts[(node["status"], node["mode"] or "none")] += 1
        agents += bool(node["connected"])
    for (status, mode), n in node_counts.items():
        nodes.add_metric([status, mode], n)
    yield nodes

    gpus = GaugeMetricFamily(
        "gpulab_gpus",
        "GPUs by state: free, busy (one job), shared (several), unavailable"
        " (lost, MIG, node down, draining or in maintenance).",
        labels=["state"],
    )
    gpu_counts = dict.fromkeys(GPU_STATES, 0)
    for gpu in state["gpus"].values():
        gpu_counts[gpu["state"]] = gpu_counts.get(gpu["state"], 0) + 1
    for name, n in gpu_counts.items():
        gpus.add_metric([name], n)
    yield gpus

    # "job_id", not "job": Prometheus' own target label is "job".
    labels = ["node", "gpu", "user", "job_id"]
    per_gpu = {
        "util": GaugeMetricFamily(
            "gpulab_gpu_utilization_percent",
            "GPU utilisation (%), newest reading.",
            labels=labels,
        ),
        "mem": GaugeMetricFamily(
            "gpulab_gpu_memory_used_bytes",
            "GPU memory in use (bytes), newest reading.",
            labels=labels,
        ),
        "power": GaugeMetricFamily(
            "gpulab_gpu_power_watts",
            "GPU power draw (W), newest reading.",
            labels=labels,
        ),
        "temp": GaugeMetricFamily(
            "gpulab_gpu_temperature_celsius",
            "GPU temperature (degrees C), newest reading.",
            labels=labels,
        ),
    }
    names = {n["id"]: n["name"] for n in state["nodes"]}
    for gpu in state["gpus"].values():
        if gpu["stale"]:  # node gone or silent: its series go stale
            continue
        user, job = _holder_labels(gpu)
        values = [names[gpu["node"]], str(gpu["index"]), user, job]
        mem = gpu["mem"]
        readings = {
            "util": gpu["util"],
            "mem": None if mem is None else mem * MIB,
            "power": gpu["power"],
            "temp": gpu["temp"],
        }
        for field, family in per_gpu.items():
            reading = readings[field]
            if reading is not None:
                family.add_metric(values, reading)
    yield from per_gpu.values()

    clients = GaugeMetricFamily(
        "gpulab_websocket_clients",
        "Open websockets: agents (nodes connected) and browsers (live pages).",
        labels=["kind"],
    )
    clients.add_metric(["agent"], agents)
    clients.add_metric(["browser"], _browser_clients())
    yield clients


def _browser_clients() -> int:
    """Browsers on /ws/dashboard/ over every web process (each process's count
    as its hub last reported it; a process not heard for a minute is left out)."""
    raw = cast("dict[bytes, bytes]", _redis_client().hgetall(clients_key()))
    total = 0
    now = time.time()
    for value in raw.values():
        count, _, expiry = value.decode().partition(" ")
        if float(expiry or 0) > now:
            total += int(count)
    return total


# ------------------------------------------------------------------ charges


def charges(now: datetime) -> Iterator[Metric]:
    """GPU-hours charged per group (ended attempts' usage records) and each
    quota's use in its current period (running jobs included)."""
    hours = CounterMetricFamily(
        "gpulab_group_gpu_hours",
        "GPU-hours charged to each group for attempts that ended (usage records).",
        labels=["group"],
    )
    # The totals PostgreSQL keeps as records are written (one row per group),
    # not a sum over the whole ledger at each scrape.
    ledger.fold()
    for name, seconds in ledger.group_seconds():
        hours.add_metric([name], seconds / 3600.0)
    yield hours

    labels = ["quota", "group", "user", "period", "kind"]
    used = GaugeMetricFamily(
        "gpulab_quota_used_gpu_hours",
        "GPU-hours a quota used in its current period, running jobs included.",
        labels=labels,
    )
    limit = GaugeMetricFamily(
        "gpulab_quota_limit_gpu_hours", "A quota's GPU-hour limit.", labels=labels
    )
    gpus = GaugeMetricFamily(
        "gpulab_quota_running_gpus",
        "GPUs a quota's running jobs hold.",
        labels=labels,
    )
    for st in quota_states(now):
        q = st.quota
        values = [
            str(q.pk),
            q.group.name if q.group is not None else "",
            q.user.get_username() if q.user is not None else "",
            q.period_label,
            "hard" if q.hard else "soft",
        ]
        used.add_metric(values, st.used_gpu_hours)
        if st.limit_gpu_hours is not None:
            limit.add_metric(values, st.limit_gpu_hours)
        gpus.add_metric(values, st.running_gpus)
    yield from (used, limit, gpus)


# ------------------------------------------------------------------ ingest


def ingest(now: datetime) -> Iterable[Metric]:
    """The metrics frames stored by every web process (a counter: its rate is
    the frames per second) and each node's ingest lag."""
    frames = CounterMetricFamily(
        "gpulab_ingest_frames",
        "Agents' metrics frames stored by the web processes (rate: frames/s).",
    )
    raw = cast("bytes | None", _redis_client().get(frames_key()))
    frames.add_metric([], int(raw or 0))
    lag = GaugeMetricFamily(
        "gpulab_node_metrics_age_seconds",
        "Age of the newest stored reading of each connected node (ingest lag).",
        labels=["node"],
    )
    rows = (
        Node.objects.filter(connected=True)
        .order_by("name")
        .values_list("name")
        .annotate(latest=Max("gpus__latest_at"))
    )
    for name, latest in rows:
        if latest is not None:
            lag.add_metric([name], max(0.0, (now - latest).total_seconds()))
    return [frames, lag]
