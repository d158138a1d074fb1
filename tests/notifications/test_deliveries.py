"""Notifications: the outbox, webhook signing against a real HTTP server,
retries with exponential backoff, final failures, e-mail (Django's locmem outbox),
and the job hooks in scheduler.services."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.core import mail
from django.db import connection

from portal.notifications import services, signing
from portal.notifications.models import Delivery, Kind, Preference
from scheduler import services as scheduler_services
from scheduler.models import Job
from tests.conftest import make_node
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from tests.notifications.conftest import Receiver

SECRET = "s3cret-shared-with-the-receiver"


def webhook_only(user: User, url: str, **extra: Any) -> Preference:
    pref = Preference(user=user, email_enabled=False, webhook_url=url, **extra)
    pref.set_webhook_secret(SECRET)
    pref.save()
    return pref


def test_a_webhook_is_posted_with_a_verifiable_signature(
    alice: User, receiver: Receiver
) -> None:
    webhook_only(alice, receiver.url)
    [row] = services.notify(
        alice, Kind.IDLE_WARNING, "Job #7 is idle", "text", {"job_id": 7}
    )

    result = services.send(row.pk)

    assert result is not None and result.status == Delivery.Status.SENT
    [got] = receiver.requests
    assert signing.verify(
        SECRET,
        got.headers[signing.TIMESTAMP_HEADER],
        got.headers[signing.SIGNATURE_HEADER],
        got.body,
    )
    assert not signing.verify(
        "another secret",
        got.headers[signing.TIMESTAMP_HEADER],
        got.headers[signing.SIGNATURE_HEADER],
        got.body,
    )
    # A changed body or an old timestamp does not verify.
    assert not signing.verify(
        SECRET, got.headers[signing.TIMESTAMP_HEADER],
        got.headers[signing.SIGNATURE_HEADER], got.body + b" ",
    )  # fmt: skip
    stale = int(got.headers[signing.TIMESTAMP_HEADER]) + 301
    assert not signing.verify(
        SECRET, got.headers[signing.TIMESTAMP_HEADER],
        got.headers[signing.SIGNATURE_HEADER], got.body, now=stale,
    )  # fmt: skip
    document = json.loads(got.body)
    assert document["kind"] == "idle_warning"
    assert document["payload"] == {"job_id": 7}
    assert document["user"] == "alice"
    assert got.headers["X-Gpulab-Event"] == "idle_warning"
    row.refresh_from_db()
    assert row.status == Delivery.Status.SENT and row.sent_at is not None


def test_a_failing_webhook_is_retried_with_backoff_then_recorded_as_failed(
    alice: User, receiver: Receiver, settings: Any
) -> None:
    settings.GPULAB_NOTIFY_MAX_ATTEMPTS = 3
    settings.GPULAB_NOTIFY_BACKOFF = 30.0
    receiver.statuses = [500]
    webhook_only(alice, receiver.url)
    [row] = services.notify(alice, Kind.JOB_FAILED, "Job #1 failed", "text")
    # The clock of the sends starts when the row became due (its creation), so
    # the test does not depend on today's date.
    now = row.next_attempt_at

    first = services.send(row.pk, now=now)
    assert first is not None and first.retry_in == 30.0
    row.refresh_from_db()
    assert row.status == Delivery.Status.PENDING
    assert row.next_attempt_at == now + timedelta(seconds=30)
    assert row.last_error == "attempt 1: HTTP 500 from the webhook"
    # Not due yet: nothing is sent.
    assert services.send(row.pk, now=now + timedelta(seconds=29)) is None
    assert len(receiver.requests) == 1

    second = services.send(row.pk, now=now + timedelta(seconds=30))
    assert second is not None and second.retry_in == 60.0  # doubled
    assert services.send(row.pk, now=now + timedelta(seconds=89)) is None
    third = services.send(row.pk, now=now + timedelta(seconds=90))

    assert third is not None and third.status == Delivery.Status.FAILED
    assert len(receiver.requests) == 3
    row.refresh_from_db()
    assert row.status == Delivery.Status.FAILED and row.attempts == 3
    assert row.last_error == "gave up after 3 attempts: HTTP 500 from the webhook"
    assert services.send(row.pk, now=now + timedelta(days=1)) is None


def test_a_webhook_that_recovers_is_sent(alice: User, receiver: Receiver) -> None:
    receiver.statuses = [503, 200]
    webhook_only(alice, receiver.url)
    [row] = services.notify(alice, Kind.JOB_ENDED, "Job #1 completed", "text")
    now = row.next_attempt_at

    services.send(row.pk, now=now)
    result = services.send(row.pk, now=now + timedelta(seconds=30))

    assert result is not None and result.status == Delivery.Status.SENT
    assert [r.headers["X-Gpulab-Delivery"] for r in receiver.requests] == [
        str(row.pk)
    ] * 2


def test_a_sent_delivery_is_never_claimed_again(
    alice: User, receiver: Receiver
) -> None:
    webhook_only(alice, receiver.url)
    [row] = services.notify(alice, Kind.JOB_ENDED, "Job #1 completed", "text")
    services.send(row.pk)
    row.refresh_from_db()

    with pytest.raises(ValueError, match="sent -> sending is not allowed"):
        services.set_status(row, Delivery.Status.SENDING)

    row.refresh_from_db()
    assert (row.status, row.attempts) == (Delivery.Status.SENT, 1)
    assert services.send(row.pk) is None  # not due: nothing sent twice
    assert len(receiver.requests) == 1


def test_backoff_is_capped(settings: Any) -> None:
    settings.GPULAB_NOTIFY_BACKOFF = 30.0
    settings.GPULAB_NOTIFY_BACKOFF_CAP = 100.0
    assert [services.backoff(n) for n in (1, 2, 3, 4)] == [30.0, 60.0, 100.0, 100.0]


def test_email_goes_through_djangos_mail_backend(alice: User) -> None:
    [row] = services.notify(alice, Kind.JOB_FAILED, "Job #3 failed", "exit code 1")
    assert row.channel == Delivery.Channel.EMAIL and row.target == "alice@lab.example"

    services.send(row.pk)

    [message] = mail.outbox
    assert message.to == ["alice@lab.example"]
    assert message.subject == "[gpulab] Job #3 failed"
    assert message.body == "exit code 1"


def test_preferences_choose_the_events_and_channels(
    alice: User, receiver: Receiver
) -> None:
    # Defaults: e-mail, every event but starts.
    assert services.notify(alice, Kind.JOB_STARTED, "s", "t") == []
    assert len(services.notify(alice, Kind.QUOTA_WARNING, "s", "t")) == 1
    Preference.objects.create(
        user=alice, kinds=[Kind.JOB_STARTED], email_enabled=True,
        webhook_url=receiver.url,
    )  # fmt: skip
    made = services.notify(alice, Kind.JOB_STARTED, "s", "t")
    assert sorted(r.channel for r in made) == ["email", "webhook"]
    assert services.notify(alice, Kind.JOB_FAILED, "s", "t") == []
    with pytest.raises(ValueError, match="unknown notification kind"):
        services.notify(alice, "nonsense", "s", "t")


def test_a_user_without_an_address_gets_no_email(alice: User) -> None:
    alice.email = ""
    alice.save()
    assert services.notify(alice, Kind.JOB_FAILED, "s", "t") == []


def test_job_start_end_and_failure_are_notified_from_the_services(
    alice: User, db: None, django_capture_on_commit_callbacks: Any
) -> None:
    Preference.objects.create(
        user=alice, kinds=[Kind.JOB_STARTED, Kind.JOB_ENDED, Kind.JOB_FAILED]
    )
    node, _ = make_node("n-notify", 2)
    ok, bad = JobFactory(owner=alice), JobFactory(owner=alice)
    with django_capture_on_commit_callbacks():
        attempts = [start_job(job, node) for job in (ok, bad)]
        for attempt in attempts:
            assert scheduler_services.mark_started(node.pk, started_data(attempt))
        assert scheduler_services.finish_attempt(node.pk, exited_data(attempts[0], 0))
        assert scheduler_services.finish_attempt(node.pk, exited_data(attempts[1], 3))

    kinds = list(Delivery.objects.order_by("id").values_list("kind", "payload__job_id"))
    assert kinds == [
        ("job_started", ok.pk),
        ("job_started", bad.pk),
        ("job_ended", ok.pk),
        ("job_failed", bad.pk),
    ]
    failed = Delivery.objects.get(kind="job_failed")
    assert failed.payload["exit_code"] == 3
    assert "failed with exit code 3" in failed.text


def test_an_arrays_cancel_tells_its_owner_once_not_once_per_task(
    alice: User, db: None, django_capture_on_commit_callbacks: Any
) -> None:
    Preference.objects.create(user=alice, kinds=[Kind.JOB_ENDED])
    make_node("n-notify", 2)
    array = scheduler_services.submit_array(
        alice,
        scheduler_services.JobRequest(name="sweep", command="true", workdir="/tmp/w"),
        "0-49",
    )
    with django_capture_on_commit_callbacks(execute=True):
        cancelled = scheduler_services.cancel_array(array.pk, by=alice)

    [row] = Delivery.objects.all()
    subject = f"array {array.pk} (sweep): 50 waiting tasks cancelled by alice"
    assert (row.kind, row.channel, row.subject) == ("job_ended", "email", subject)
    assert row.payload == {
        "job_ids": cancelled,
        "array_id": array.pk,
        "status": "cancelled",
        "count": 50,
        "message": subject,
    }
    assert row.text.startswith(f"{subject}: jobs #{cancelled[0]}, #{cancelled[1]},")
    assert row.text.endswith(f"#{cancelled[19]} and 30 more.")
    assert services.send(row.pk) is not None
    assert [m.subject for m in mail.outbox] == [f"[gpulab] {subject}"]


def test_the_sweep_sends_what_no_queue_holds(alice: User) -> None:
    [row] = services.notify(alice, Kind.JOB_FAILED, "Job #3 failed", "text")
    from portal.notifications.tasks import sweep

    assert sweep() == 1
    row.refresh_from_db()
    assert row.status == Delivery.Status.SENT
    assert len(mail.outbox) == 1


@pytest.mark.django_db(transaction=True)
def test_a_hanging_webhook_does_not_hold_up_scheduling(
    alice: User, receiver: Receiver, settings: Any
) -> None:
    """The worker sending to a webhook that never answers is busy; meanwhile a
    scheduling pass starts a job and the agent's start is recorded, each of which
    only writes an outbox row."""
    settings.GPULAB_WEBHOOK_TIMEOUT = 20.0
    receiver.hang = True
    webhook_only(alice, receiver.url, kinds=[Kind.JOB_STARTED, Kind.JOB_FAILED])
    [first] = services.notify(alice, Kind.JOB_FAILED, "Job #1 failed", "text")

    def send_then_close() -> None:
        try:
            services.send(first.pk)
        finally:
            connection.close()  # the thread's own database session

    sender = threading.Thread(target=send_then_close)
    sender.start()
    try:
        assert receiver.arrived.wait(10)  # the send is in progress and hangs
        node, _ = make_node("n-hang", 1)
        job = JobFactory(owner=alice)
        from scheduler.pass_runner import schedule_pass_body

        schedule_pass_body()
        job.refresh_from_db()
        assert job.status == Job.Status.STARTING
        attempt = job.attempt_set.get()
        assert scheduler_services.mark_started(node.pk, started_data(attempt))
        assert Job.objects.get(pk=job.pk).status == Job.Status.RUNNING
        # Still hanging: the start was recorded without waiting for it.
        assert sender.is_alive() and not receiver.release.is_set()
        assert Delivery.objects.filter(
            kind=Kind.JOB_STARTED, status=Delivery.Status.PENDING
        ).exists()
    finally:
        receiver.release.set()
        sender.join(30)
    first.refresh_from_db()
    assert first.status == Delivery.Status.SENT
