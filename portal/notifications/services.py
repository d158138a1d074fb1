"""Notify users: ``notify`` writes outbox rows; ``send`` delivers one (a task).

Nothing here talks to a mail server or a webhook inside the caller's transaction:
``notify`` only inserts ``Delivery`` rows (in the caller's transaction, so a
notification exists exactly when the change it reports was committed) and, on
commit, enqueues ``deliver`` on the notifications queue, which a worker of its own
consumes. A slow or failing receiver therefore never delays scheduling or agent
messages.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents import jobtext
from portal.notifications import secrets, signing, targets
from portal.notifications.models import Delivery, Kind, Preference

if TYPE_CHECKING:
    from collections.abc import Sequence

    from django.contrib.auth.models import AbstractBaseUser

    from scheduler.models import Attempt, Job

log = logging.getLogger(__name__)


def preference_of(user: AbstractBaseUser) -> Preference:
    """The user's preferences (unsaved defaults when they never edited them)."""
    pref = Preference.objects.filter(user_id=user.pk).first()
    return pref if pref is not None else Preference(user_id=user.pk)


def notify(
    user: AbstractBaseUser,
    kind: str,
    subject: str,
    text: str,
    payload: dict[str, Any] | None = None,
) -> list[Delivery]:
    """Tell ``user`` about ``kind`` by the channels they chose (none: nothing).

    Writes one ``Delivery`` per channel in the current transaction; each is sent
    after commit by ``tasks.deliver`` (retried with backoff; see ``send``).
    Returns the rows made.
    """
    if kind not in Kind.values:
        raise ValueError(f"unknown notification kind {kind!r}")
    pref = preference_of(user)
    if not pref.wants(kind):
        return []
    rows = []
    common = {
        "user_id": user.pk,
        "kind": kind,
        "subject": subject[:200],
        "text": text,
        "payload": payload or {},
    }
    email = getattr(user, "email", "")
    if pref.email_enabled and email:
        rows.append(Delivery(channel=Delivery.Channel.EMAIL, target=email, **common))
    if pref.webhook_url:
        rows.append(
            Delivery(
                channel=Delivery.Channel.WEBHOOK, target=pref.webhook_url, **common
            )
        )
    if not rows:
        return []
    made = Delivery.objects.bulk_create(rows)
    for row in made:
        transaction.on_commit(partial(enqueue, row.pk))
    return made


def enqueue(delivery_id: int, countdown: float | None = None) -> None:
    """Hand a delivery to the notifications queue. A broker that is down loses
    nothing: the row stays due and ``sweep`` (beat) enqueues it again."""
    from portal.notifications.tasks import deliver

    try:
        if countdown is None:
            deliver.delay(delivery_id)
        else:
            deliver.apply_async((delivery_id,), countdown=countdown)
    except Exception:
        log.exception("could not enqueue notification %s; beat will retry", delivery_id)


# ------------------------------------------------------------------ sending


@dataclass(frozen=True)
class SendResult:
    delivery_id: int
    status: str
    retry_in: float | None = None


def backoff(attempts: int) -> float:
    """Seconds to wait after the ``attempts``-th failure: base * 2^(attempts-1),
    capped."""
    base = settings.GPULAB_NOTIFY_BACKOFF
    return float(min(settings.GPULAB_NOTIFY_BACKOFF_CAP, base * 2 ** (attempts - 1)))


def _claim(delivery_id: int, now: datetime) -> Delivery | None:
    """Take a due delivery (PENDING, or SENDING whose claim expired: a worker died
    mid-send) for one send. Two tasks never send the same row at once."""
    hold = timedelta(seconds=settings.GPULAB_WEBHOOK_TIMEOUT + 60)
    with transaction.atomic():
        row = (
            Delivery.objects.select_for_update(skip_locked=True)
            .select_related("user")
            .filter(pk=delivery_id, next_attempt_at__lte=now)
            .filter(
                Q(status=Delivery.Status.PENDING)
                | Q(status=Delivery.Status.SENDING, claimed_until__lt=now)
            )
            .first()
        )
        if row is None:
            return None
        set_status(
            row,
            Delivery.Status.SENDING,
            claimed_until=now + hold,
            attempts=row.attempts + 1,
        )
    return row


# A delivery's states: PENDING -> SENDING when a worker claims it (again, once
# the claim of a worker that died expired); SENDING -> SENT, back to PENDING
# (retried later) or FAILED (given up).
TRANSITIONS = frozenset(
    {
        (Delivery.Status.PENDING, Delivery.Status.SENDING),
        (Delivery.Status.SENDING, Delivery.Status.SENDING),
        (Delivery.Status.SENDING, Delivery.Status.SENT),
        (Delivery.Status.SENDING, Delivery.Status.PENDING),
        (Delivery.Status.SENDING, Delivery.Status.FAILED),
    }
)


def set_status(row: Delivery, status: Delivery.Status, **fields: Any) -> None:
    """The only writer of a delivery's status: ``row`` (as last read) moves to
    ``status`` with ``fields``, in one UPDATE; ``ValueError`` for a change
    ``TRANSITIONS`` does not allow, nothing written."""
    if (row.status, status) not in TRANSITIONS:
        raise ValueError(f"delivery {row.pk}: {row.status} -> {status} is not allowed")
    Delivery.objects.filter(pk=row.pk).update(status=status, **fields)
    row.status = status
    for name, value in fields.items():
        setattr(row, name, value)


def send(delivery_id: int, now: datetime | None = None) -> SendResult | None:
    """Send one due delivery once. Returns None when it is not due (or is taken).

    A failure sets it PENDING again ``backoff(attempts)`` later, or FAILED with the
    error after ``GPULAB_NOTIFY_MAX_ATTEMPTS`` tries; the user sees both on their
    notifications page.
    """
    now = now or timezone.now()
    row = _claim(delivery_id, now)
    if row is None:
        return None
    try:
        if row.channel == Delivery.Channel.EMAIL:
            _send_email(row)
        else:
            _send_webhook(row)
    except Exception as exc:
        error = _describe(exc)
        if row.attempts >= settings.GPULAB_NOTIFY_MAX_ATTEMPTS:
            set_status(
                row,
                Delivery.Status.FAILED,
                claimed_until=None,
                last_error=f"gave up after {row.attempts} attempts: {error}"[:500],
            )
            log.warning("notification %s failed for good: %s", row.pk, error)
            return SendResult(row.pk, Delivery.Status.FAILED)
        wait = backoff(row.attempts)
        set_status(
            row,
            Delivery.Status.PENDING,
            claimed_until=None,
            next_attempt_at=now + timedelta(seconds=wait),
            last_error=f"attempt {row.attempts}: {error}"[:500],
        )
        return SendResult(row.pk, Delivery.Status.PENDING, retry_in=wait)
    set_status(row, Delivery.Status.SENT, claimed_until=None, sent_at=timezone.now())
    return SendResult(row.pk, Delivery.Status.SENT)


def _describe(exc: Exception) -> str:
    if isinstance(exc, targets.RefusedTarget | NotSent):
        return f"not sent: {exc}"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from the webhook"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {settings.GPULAB_WEBHOOK_TIMEOUT} s"
    return f"{type(exc).__name__}: {exc}"


def _send_email(row: Delivery) -> None:
    send_mail(
        f"[gpulab] {row.subject}",
        row.text,
        settings.DEFAULT_FROM_EMAIL,
        [row.target],
        fail_silently=False,
    )


def webhook_request(
    row: Delivery, secret: str, now: float
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of the webhook POST (signed when a secret is set)."""
    body = json.dumps(row.body(), separators=(",", ":"), sort_keys=True).encode()
    timestamp = int(now)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "gpulab-webhook/1",
        "X-Gpulab-Event": row.kind,
        "X-Gpulab-Delivery": str(row.pk),
        signing.TIMESTAMP_HEADER: str(timestamp),
    }
    if secret:
        headers[signing.SIGNATURE_HEADER] = signing.sign(secret, timestamp, body)
    return body, headers


class NotSent(Exception):
    """A webhook the portal will not send as things stand (``str()`` says why)."""


def _send_webhook(row: Delivery) -> None:
    """POST the delivery, signed with its owner's secret, to an address of the
    URL's host that ``targets`` allows (each in turn, if one refuses the
    connection), the Host header and TLS server name kept; no redirects, no
    proxy from the environment."""
    stored = (
        Preference.objects.filter(user_id=row.user_id)
        .values_list("webhook_secret", flat=True)
        .first()
    ) or ""
    try:
        secret = secrets.decrypt(stored)
    except secrets.Unreadable:
        raise NotSent(
            "the webhook secret can no longer be read (the portal's encryption key "
            "changed): set it again on the notifications page"
        ) from None
    body, headers = webhook_request(row, secret, timezone.now().timestamp())
    addresses = targets.check(row.target)  # resolved once, every address checked
    refused: httpx.ConnectError | None = None
    with httpx.Client(
        timeout=settings.GPULAB_WEBHOOK_TIMEOUT, follow_redirects=False, trust_env=False
    ) as client:
        for address in addresses:
            pin = targets.pinned(row.target, address)
            try:
                response = client.post(
                    pin.url,
                    content=body,
                    headers={**headers, "Host": pin.host_header},
                    extensions=(
                        {"sni_hostname": pin.server_name} if pin.server_name else {}
                    ),
                )
            except httpx.ConnectError as exc:
                refused = exc
                continue
            response.raise_for_status()
            return
    assert refused is not None
    raise refused


def due(now: datetime | None = None, limit: int = 500) -> list[int]:
    """Deliveries due now (and sends whose worker died): what ``sweep`` enqueues."""
    now = now or timezone.now()
    return list(
        Delivery.objects.filter(next_attempt_at__lte=now)
        .filter(
            Q(status=Delivery.Status.PENDING)
            | Q(status=Delivery.Status.SENDING, claimed_until__lt=now)
        )
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )


# ------------------------------------------------------------------ job events

_END_KINDS = {
    "completed": Kind.JOB_ENDED,
    "cancelled": Kind.JOB_ENDED,
    "timeout": Kind.JOB_ENDED,
    "failed": Kind.JOB_FAILED,
}


def _job_notice(job: Job, kind: str, what: str, message: str) -> None:
    url = (
        f"{settings.GPULAB_BASE_URL}/jobs/{job.pk}/" if settings.GPULAB_BASE_URL else ""
    )
    # People read the subject and text: a bidirectional control in the name or
    # the message (a launch error quotes the job's own text) shows as a marker
    # there (agents.jobtext); the data keeps them exact for programs.
    text = jobtext.mark_bidi(f"Job #{job.pk} ({job.name}) {what}: {message}")
    if url:
        text += f"\n\n{url}"
    notify(
        job.owner,
        kind,
        jobtext.mark_bidi(f"Job #{job.pk} {job.name} {what}"),
        text,
        {
            "job_id": job.pk,
            "name": job.name,
            "status": str(job.status),
            "message": message,
            "exit_code": job.exit_code,
            "url": url,
        },
    )


def job_preempted(job: Job, attempt: Attempt, message: str) -> None:
    """Called by ``scheduler.services.finish_attempt`` when a preempted job is
    back in the queue: its owner reads whom it yielded to, the work ``attempt``
    lost (charged to nobody) and that it waits to resume."""
    parts = [message]
    if attempt.preempted_for_id is not None:
        parts.append(f"its GPUs went to job #{attempt.preempted_for_id}")
    if attempt.lost_work_gpu_s is not None:
        minutes = round(attempt.lost_work_gpu_s / max(1, job.gpus) / 60)
        since = (
            "since its last checkpoint"
            if job.checkpointable and attempt.lost_since != attempt.started_at
            else "since its start"
        )
        parts.append(f"{minutes} min of work lost {since} (charged to nobody's quota)")
    parts.append(
        "it waits in the queue to resume from its last checkpoint"
        if job.checkpointable
        else "it waits in the queue to start again"
    )
    _job_notice(job, Kind.JOB_PREEMPTED, "preempted", "; ".join(parts))


def job_changed(job: Job, message: str) -> None:
    """Called (inside its transaction) wherever ``scheduler.services`` records a
    job's new status: an end or a failure is told to its owner."""
    kind = _END_KINDS.get(str(job.status))
    if kind is not None:
        _job_notice(job, kind, str(job.status), message)


def jobs_changed(jobs: Sequence[Job], summary: str) -> None:
    """Called (inside its transaction) when ``scheduler.services`` moved many
    jobs to one status at once (an array's waiting tasks cancelled): an end is
    told to each owner once, ``summary`` as the subject, the jobs' numbers in
    the text (the first 20) and the payload (all), not once per job."""
    owners: dict[int, list[Job]] = {}
    for job in jobs:
        owners.setdefault(job.owner_id, []).append(job)
    for mine in owners.values():
        kind = _END_KINDS.get(str(mine[0].status))
        if kind is None:
            continue
        ids = sorted(job.pk for job in mine)
        shown = ", ".join(f"#{i}" for i in ids[:20])
        more = f" and {len(ids) - 20} more" if len(ids) > 20 else ""
        subject = jobtext.mark_bidi(summary)
        array_ids = {job.array_id for job in mine}
        array_id = array_ids.pop() if len(array_ids) == 1 else None
        notify(
            mine[0].owner,
            kind,
            subject,
            f"{subject}: jobs {shown}{more}.",
            {
                "job_ids": ids,
                "array_id": array_id,
                "status": str(mine[0].status),
                "count": len(ids),
                "message": summary,
            },
        )


def job_started(job: Job, message: str) -> None:
    """Called by ``scheduler.services.mark_started`` when a job starts running."""
    _job_notice(job, Kind.JOB_STARTED, "started", message)


class Handlers:
    """``scheduler.hooks.Notifier``: job events told to their owners."""

    def job_started(self, job: Job, message: str) -> None:
        job_started(job, message)

    def job_changed(self, job: Job, message: str) -> None:
        job_changed(job, message)

    def jobs_changed(self, jobs: Sequence[Job], summary: str) -> None:
        jobs_changed(jobs, summary)

    def job_preempted(self, job: Job, attempt: Attempt, message: str) -> None:
        job_preempted(job, attempt, message)
