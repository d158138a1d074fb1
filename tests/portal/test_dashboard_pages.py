"""The dashboards as the server renders them (what a browser without JavaScript
sees, and the fragments and series the page scripts fetch): the cluster's headline
and tiles, the node and GPU pages with their ranges, the job's chart series, the
queue with its actions, and the node actions for staff."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.urls import reverse

from agents import protocol
from scheduler import metrics, services
from scheduler.models import Gpu, GpuRollup, Job, Node
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def body(response: Any) -> str:
    assert response.status_code == 200, response.status_code
    return " ".join(response.content.decode().split())


def reading(gpu: Gpu, attempt_id: int | None = None, **values: Any) -> None:
    """The GPU's latest sample as the agent consumer keeps it."""
    processes = [{"pid": 4242, "used_memory_mib": 3000, "attempt_id": attempt_id}]
    Gpu.objects.filter(pk=gpu.pk).update(
        latest={
            "util_gpu": 91.0,
            "memory_used_mib": 3500,
            "temperature_c": 66.0,
            "power_w": 280.0,
            "processes": processes,
            **values,
        },
        latest_at=datetime.now(tz=UTC),
    )


def store_history(node: Node, minutes: int = 10) -> datetime:
    """A sample a minute for the last ``minutes`` on each GPU, and one minute
    rollup per GPU (now-relative: the partitions are made for today)."""
    now = datetime.now(tz=UTC)
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, now)
    gpus = list(node.gpus.order_by("index"))
    for m in range(minutes, 0, -1):
        at = now - timedelta(minutes=m)
        frame = protocol.MetricsData(
            sampled_at=at.timestamp(),
            gpus=[
                protocol.GpuSample(
                    index=g.index,
                    uuid=g.uuid,
                    util_gpu=float(m),
                    memory_used_mib=1000,
                    power_w=100.0,
                    temperature_c=40.0,
                    processes=[protocol.ProcessSample(pid=77, used_memory_mib=500)],
                )
                for g in gpus
            ],
        )
        metrics.store_samples({g.index: g.pk for g in gpus}, frame, now=now)
    for g in gpus:
        GpuRollup.objects.create(
            gpu=g,
            resolution="1m",
            start=now - timedelta(hours=1),
            samples=6,
            util_gpu_mean=42.0,
        )
        GpuRollup.objects.create(
            gpu=g,
            resolution="1h",
            start=now - timedelta(days=2),
            samples=360,
            util_gpu_mean=24.0,
        )
    return now


def store_process_sample(gpu: Gpu, attempt_id: int) -> None:
    """One more sample, a minute ago, with a process of the attempt."""
    now = datetime.now(tz=UTC)
    frame = protocol.MetricsData(
        sampled_at=(now - timedelta(seconds=30)).timestamp(),
        gpus=[
            protocol.GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                util_gpu=99.0,
                processes=[
                    protocol.ProcessSample(
                        pid=5, used_memory_mib=1234, attempt_id=attempt_id
                    )
                ],
            )
        ],
    )
    metrics.store_samples({gpu.index: gpu.pk}, frame, now=now)


# ------------------------------------------------------------------ cluster


def test_the_cluster_page_shows_the_headline_and_each_gpu(
    alice: User, bob: User, cluster: list[Node]
) -> None:
    node_a, node_b = cluster
    attempt = start_job(JobFactory(owner=alice, name="<img src=x>"), node_a)
    gpu0 = node_a.gpus.get(index=0)
    reading(gpu0, attempt.pk)
    reading(node_a.gpus.get(index=1), None, util_gpu=3.0)  # a foreign process
    node_a.gpus.filter(index=3).update(present=False)
    JobFactory(owner=bob)  # waiting
    services.set_node_mode(node_b.pk, "drain", by=None)

    page = body(client_for(bob).get(reverse("portal-overview")))

    assert '<span data-h="busy">1</span>' in page
    assert '<dd data-h="free">2</dd>' in page  # node-a's GPU 1 and 2
    assert '<dd data-h="unavailable">3</dd>' in page  # one lost, two draining
    assert 'data-h="pending">1</a>' in page
    assert 'class="tile state-busy load-4" data-gpu="' in page
    assert "&lt;img src=x&gt;" in page and "<img src=x>" not in page
    assert "⚠ foreign: 2.9 GiB</div>" in page
    assert 'title="processes no gpulab job owns: pid 4242 (2.9 GiB)"' in page
    assert "GPU lost" in page
    assert page.count("node draining</div>") == 2
    assert 'class="node status-up mode-draining"' in page
    # bob sees alice's job on the grid, not a link to its page (a 404 for him)
    assert f"<span>#{attempt.job_id}</span>" in page
    assert f'href="/jobs/{attempt.job_id}/"' not in page


def test_the_overview_fragment_for_a_reconnecting_page_has_headline_and_grid(
    alice: User, cluster: list[Node]
) -> None:
    response = client_for(alice).get(
        reverse("portal-overview"), headers={"HX-Request": "true"}
    )

    page = body(response)
    assert 'id="headline"' in page
    assert 'id="node-grid"' in page
    assert "<html" not in page


# ------------------------------------------------------------------ node, GPU


@pytest.mark.parametrize("persona", ["alice", "charlie", "admin_user"])
def test_the_node_page_shows_its_gpus_and_their_history(
    request: pytest.FixtureRequest, cluster: list[Node], persona: str
) -> None:
    node = cluster[1]
    store_history(node)

    response = client_for(request.getfixturevalue(persona)).get(
        reverse("portal-node", args=[node.pk])
    )

    page = body(response)
    series = response.context["series"]
    assert series["range"] == "15m"
    assert series["resolution"] == "raw"
    assert [g["label"] for g in series["gpus"]] == ["GPU 0", "GPU 1"]
    assert series["gpus"][0]["util"] == [float(m) for m in range(10, 0, -1)]
    assert [p["label"] for p in series["procs"]] == [
        "GPU 0: foreign pid 77",
        "GPU 1: foreign pid 77",
    ]
    assert page.count('data-testid="gpu-tile"') == 2
    assert 'id="series"' in page
    assert "The charts need JavaScript" in page


@pytest.mark.parametrize(
    ("range_name", "resolution", "util"),
    [("15m", "raw", 10.0), ("6h", "1m", 42.0), ("7d", "1h", 24.0)],
)
def test_each_range_reads_its_resolution(
    alice: User, cluster: list[Node], range_name: str, resolution: str, util: float
) -> None:
    node = cluster[1]
    store_history(node)

    response = client_for(alice).get(
        reverse("portal-node-series", args=[node.pk]), {"range": range_name}
    )

    data = response.json()
    assert response.status_code == 200
    assert data["resolution"] == resolution
    assert data["gpus"][0]["util"][0] == util


@pytest.mark.parametrize("range_name", ["15m", "6h", "7d"])
def test_a_chart_series_is_three_queries_whatever_the_range(
    alice: User, cluster: list[Node], django_assert_num_queries: Any, range_name: str
) -> None:
    from portal.views.cluster import chart_series

    node = cluster[0]
    gpus = list(node.gpus.order_by("index"))
    attempt = start_job(JobFactory(owner=alice, name="mine"), node)
    store_history(node, minutes=3)
    store_process_sample(gpus[0], attempt.pk)

    with django_assert_num_queries(3):  # readings, memory per owner, job names
        series = chart_series(gpus, metrics.RANGES[range_name], range_name)

    assert len(series["gpus"]) == 4
    labels = {p["label"] for p in series["procs"]}
    assert f"GPU 0: #{attempt.job_id} mine (alice)" in labels


@pytest.mark.parametrize("name", ["portal-node", "portal-node-series"])
def test_a_bad_range_is_refused_with_the_ranges_named(
    alice: User, cluster: list[Node], name: str
) -> None:
    response = client_for(alice).get(
        reverse(name, args=[cluster[0].pk]), {"range": "<1y>"}
    )

    text = response.content.decode()
    assert response.status_code == 400
    assert "unknown range '<1y>': use one of 15m, 6h, 7d" in text
    # the value is named back only as plain text or JSON, never as HTML
    assert response["Content-Type"].split(";")[0] in ("text/plain", "application/json")


def test_the_gpu_page_names_each_process_and_flags_foreign_ones(
    alice: User, charlie: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    attempt = start_job(JobFactory(owner=alice, name="resnet"), node)
    gpu = node.gpus.get(index=0)
    Gpu.objects.filter(pk=gpu.pk).update(
        latest={
            "util_gpu": 50.0,
            "processes": [
                {"pid": 1, "used_memory_mib": 2048, "attempt_id": attempt.pk},
                {"pid": 2, "used_memory_mib": 512, "attempt_id": None},
            ],
        }
    )

    page = body(client_for(charlie).get(reverse("portal-gpu", args=[node.pk, 0])))

    assert f"#{attempt.job_id} resnet (alice)" in page
    assert "foreign: no gpulab job" in page
    assert f'data-gpu="{node.pk}:0"' in page


def test_an_unknown_gpu_is_a_404(alice: User, cluster: list[Node]) -> None:
    client = client_for(alice)

    assert client.get(reverse("portal-gpu", args=[cluster[1].pk, 7])).status_code == 404
    assert client.get(reverse("portal-gpu-series", args=[999, 0])).status_code == 404


# ------------------------------------------------------------------ job


def test_the_job_series_is_its_gpus_own_memory_and_only_for_those_who_see_it(
    alice: User, charlie: User, cluster: list[Node]
) -> None:
    node = cluster[1]
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)
    services.mark_started(
        node.pk,
        protocol.JobStartedData(
            attempt_id=attempt.pk,
            job_id=job.pk,
            pid=1,
            started_at=(datetime.now(tz=UTC) - timedelta(minutes=20)).timestamp(),
        ),
    )
    now = datetime.now(tz=UTC)
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, now)
    gpu = attempt.allocations.first().gpu  # type: ignore[union-attr]
    for m in (3, 2, 1):
        frame = protocol.MetricsData(
            sampled_at=(now - timedelta(minutes=m)).timestamp(),
            gpus=[
                protocol.GpuSample(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    util_gpu=float(m * 10),
                    memory_used_mib=5000,
                    processes=[
                        protocol.ProcessSample(
                            pid=1, used_memory_mib=4000, attempt_id=attempt.pk
                        ),
                        protocol.ProcessSample(pid=9, used_memory_mib=999),
                    ],
                )
            ],
        )
        metrics.store_samples({gpu.index: gpu.pk}, frame, now=now)
    url = reverse("portal-job-series", args=[job.pk])

    mine = client_for(alice).get(url)
    theirs = client_for(charlie).get(url)

    data = mine.json()
    assert data["live"] is True
    assert [(g["label"], g["util"], g["own"]) for g in data["gpus"]] == [
        (f"node-b:{gpu.index}", [30.0, 20.0, 10.0], [4000, 4000, 4000])
    ]
    assert theirs.status_code == 404


def test_the_job_page_marks_where_its_stored_output_ends(
    alice: User, cluster: list[Node]
) -> None:
    node = cluster[1]
    job = JobFactory(owner=alice)
    attempt = start_job(job, node)
    for offset, text in ((0, "one\n"), (4, "<two>\n")):
        services.append_log(
            node.pk,
            protocol.JobLogData(
                attempt_id=attempt.pk, job_id=job.pk, offset=offset, data=text
            ),
        )

    page = body(client_for(alice).get(reverse("portal-job", args=[job.pk])))

    assert f'data-last="{{&quot;{attempt.pk}:{node.pk}&quot;: 4}}"' in page
    assert "one &lt;two&gt;" in page
    assert 'id="job-gpus"' in page  # charts of its GPU


# ------------------------------------------------------------------ queue


def test_the_queue_lists_waiting_jobs_in_order_with_reasons_and_own_actions(
    alice: User, bob: User, cluster: list[Node]
) -> None:
    second = JobFactory(owner=alice, name="second")
    first = JobFactory(owner=bob, name="<b>first</b>")
    Job.objects.filter(pk=first.pk).update(
        queue_order=1, pending_message="waiting for 4 GPUs of A100"
    )
    Job.objects.filter(pk=second.pk).update(
        queue_order=2, pending_message="behind higher priority"
    )
    held = JobFactory(owner=alice, name="held-one")
    services.hold_job(held.pk, by=alice)
    start_job(JobFactory(owner=bob, name="on-gpu"), cluster[0])

    response = client_for(alice).get(reverse("portal-queue"))

    page = body(response)
    assert [j.pk for j in response.context["pending"]] == [first.pk, second.pk]
    assert page.index("&lt;b&gt;first&lt;/b&gt;") < page.index("second")
    assert "waiting for 4 GPUs of A100" in page
    assert f'formaction="/jobs/{second.pk}/hold/"' in page  # hers
    assert f'formaction="/jobs/{second.pk}/cancel/"' in page
    assert f'formaction="/jobs/{first.pk}/cancel/"' not in page  # bob's
    assert f'formaction="/jobs/{held.pk}/release/"' in page
    assert "node-a:0" in page  # where bob's job runs
    assert f'href="/jobs/{first.pk}/"' not in page


def test_the_queue_pages_long_queues_in_a_fixed_number_of_queries(
    alice: User, cluster: list[Node], django_assert_max_num_queries: Any
) -> None:
    from portal.views.cluster import QUEUE_PAGE

    Job.objects.bulk_create(
        Job(
            owner=alice,
            group=alice.lab_groups.first(),
            name=f"w{i}",
            command="x",
            workdir="/tmp",
            time_limit_s=60,
            queue_order=i + 1,
        )
        for i in range(QUEUE_PAGE + 5)
    )
    for node in cluster:
        start_job(JobFactory(owner=alice), node)
    client = client_for(alice)
    client.get(reverse("portal-queue"))  # sessions, permissions cached

    with django_assert_max_num_queries(10):
        first = client.get(reverse("portal-queue"))
    second = client.get(reverse("portal-queue"), {"page": "2"})

    assert [j.name for j in first.context["pending"]][:2] == ["w0", "w1"]
    assert len(first.context["pending"]) == QUEUE_PAGE
    assert [j.name for j in second.context["pending"]] == [
        f"w{i}" for i in range(QUEUE_PAGE, QUEUE_PAGE + 5)
    ]
    assert f"101\u2013105 of {QUEUE_PAGE + 5}" in body(second)


def test_the_queue_fragment_is_what_the_page_fetches_on_a_change(
    alice: User, cluster: list[Node]
) -> None:
    JobFactory(owner=alice, name="waiting")

    response = client_for(alice).get(
        reverse("portal-queue"), headers={"HX-Request": "true"}
    )

    names = {t.name for t in response.templates}
    assert "portal/partials/_queue.html" in names
    assert "portal/queue.html" not in names


# ------------------------------------------------------------------ node actions


def test_staff_with_the_permission_drain_and_resume_a_node_from_its_page(
    alice: User, admin_user: User, cluster: list[Node]
) -> None:
    node = cluster[0]
    url = reverse("portal-node-mode", args=[node.pk])
    admin_user.user_permissions.add(Permission.objects.get(codename="drain_node"))

    refused = client_for(alice).post(url, {"mode": "drain"})
    page_for_alice = body(client_for(alice).get(reverse("portal-node", args=[node.pk])))
    drained = client_for(admin_user).post(url, {"mode": "drain"})
    draining = Node.objects.get(pk=node.pk).draining
    bad = client_for(admin_user).post(url, {"mode": "explode"})
    client_for(admin_user).post(url, {"mode": "resume"})

    assert refused.status_code == 403
    assert url not in page_for_alice
    assert drained.status_code == 302
    assert draining is True
    assert bad.status_code == 400
    assert Node.objects.get(pk=node.pk).draining is False
