"""Idle detection end to end: a simulated agent reports a job holding 20 GiB at
0 % SM; the real worker's idle check flags it (job page, history), the owner's
webhook receives a signed warning from the notifier worker, and the best-effort
job (idle action "cancel") is cancelled after the grace period."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from tests.e2e.conftest import Stack, login, submit, wait_for_job, wait_until
from tests.notifications.conftest import receiver  # noqa: F401

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.notifications.conftest import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SECRET = "e2e-webhook-secret-123"


@pytest.fixture(autouse=True)
def _short_idle_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples persisted every second, idle after 3 s, cancelled 2 s later: set
    before ``stack`` starts the web server and worker, which read them."""
    monkeypatch.setenv("GPULAB_METRICS_PERSIST_INTERVAL", "1")
    # The receiver listens on loopback: the notifier may post there only when
    # the network is allowed, as for a lab's internal receiver.
    monkeypatch.setenv("GPULAB_WEBHOOK_ALLOWED_NETWORKS", "127.0.0.0/8, ::1/128")
    monkeypatch.setenv("GPULAB_IDLE_WINDOW", "3")
    monkeypatch.setenv("GPULAB_IDLE_CANCEL_GRACE", "2")


def run_check(stack: Stack) -> None:
    """One idle check on the real worker; returns once the worker finished it."""
    from portal.idle.tasks import check_idle

    worker = stack.procs["worker"]
    start = len(worker.lines)
    check_idle.delay()
    worker.wait_for(r"portal\.idle\.tasks\.check_idle\[.*\] succeeded", start=start)


def test_an_idle_job_is_flagged_notified_and_cancelled(
    stack: Stack,
    alice: User,
    receiver: Receiver,  # noqa: F811
) -> None:
    from portal.idle.models import IdleFlag
    from portal.notifications import signing
    from portal.notifications.models import Preference
    from scheduler.models import GpuSample, Job, JobEvent

    stack.start_notifier()
    pref = Preference(
        user=alice, kinds=["idle_warning"], email_enabled=False,
        webhook_url=receiver.url,
    )  # fmt: skip
    pref.set_webhook_secret(SECRET)
    pref.save()
    node, _agent = stack.start_node("idle-node", "1xA100-80GB", 1)
    client = login(stack.base_url, "alice", "pw-alice")
    job_id = submit(
        client, "holds-memory", "sleep 200", priority_class="best-effort",
        env="GPULAB_SIM_UTIL=0\nGPULAB_SIM_MEM_MIB=20000",
    )  # fmt: skip
    assert wait_for_job(job_id, {"running"}) == "running"
    gpu = node.gpus.get()

    # Not idle before a window of samples exists (the job is younger than it).
    run_check(stack)
    assert not IdleFlag.objects.filter(job_id=job_id).exists()

    def own_samples() -> int:
        started = Job.objects.get(pk=job_id).started_at
        return GpuSample.objects.filter(
            gpu_id=gpu.pk, at__gte=started, processes__0__attempt_id__isnull=False
        ).count()

    wait_until(lambda: own_samples() >= 5, timeout=60, what="5 s of samples")
    for _ in range(20):
        run_check(stack)
        if IdleFlag.objects.filter(job_id=job_id).exists():
            break
    flag = IdleFlag.objects.get(job_id=job_id)
    assert flag.util_max == 0.0 and flag.memory_mib == 20000
    assert flag.action == "cancel" and flag.cancel_at is not None
    assert JobEvent.objects.filter(
        job_id=job_id, message__startswith="flagged idle"
    ).exists()
    page = client.get(f"/jobs/{job_id}/").text
    assert 'data-testid="idle-flag"' in page and "It will be cancelled at" in page

    # The notifier posts the signed warning to the owner's webhook.
    assert receiver.arrived.wait(60)
    [hook] = receiver.requests
    assert signing.verify(
        SECRET,
        hook.headers[signing.TIMESTAMP_HEADER],
        hook.headers[signing.SIGNATURE_HEADER],
        hook.body,
    )
    document: dict[str, Any] = json.loads(hook.body)
    assert document["kind"] == "idle_warning"
    assert document["payload"]["job_id"] == job_id

    # Still idle after the grace period: cancelled, and the agent stops it.
    for _ in range(200):
        run_check(stack)
        if Job.objects.get(pk=job_id).cancel_requested_at is not None:
            break
    assert wait_for_job(job_id, {"cancelled"}) == "cancelled"
    assert JobEvent.objects.filter(
        job_id=job_id, message__startswith="cancel requested by gpulab (idle since"
    ).exists()
