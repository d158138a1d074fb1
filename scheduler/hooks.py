"""What the scheduler tells the portal apps above it, and what it reads from them,
through an explicit registry.

``scheduler`` never depends on ``portal`` (a layer contract checked by ``make lint``).
Each portal app registers its objects in its ``AppConfig.ready()``:

- handlers (the scheduler tells): ``portal.accounting`` charges GPU time when an
  attempt starts or ends, a late report moves a run, or late samples change idle
  time (``register_accounting``); ``portal.notifications`` tells owners about their
  jobs (``register_notifier``); ``portal.quotas`` records its alerts after each
  scheduling pass (``register_quotas``, also a provider);
- providers (the scheduler reads): ``portal.accounting`` gives the running
  attempts' GPU time by the charging rule (``register_usage``), ``portal.quotas``
  every quota's state for the pass (``register_quotas``).

The services and the pass runner call the module's functions where they need the
app, inside the transaction that made the change. The types that cross the
boundary are the Protocols below and ``scheduler.policy`` values: scheduler code
never names a portal type.

No signals: every caller names the event it reports or the figure it reads, every
handler is registered in one place, and a call with nothing registered raises
``HookMissing`` naming the app that should have registered it (a configuration
without that app is a broken one, never a silent one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import datetime

    from scheduler.models import Attempt, Job
    from scheduler.policy import QuotaView


class HookMissing(RuntimeError):
    """A job event was reported before the app that handles it registered."""


class Accounting(Protocol):
    """GPU time charged per attempt (``portal.accounting.services``)."""

    def attempt_started(self, attempt: Attempt) -> None:
        """A start reported after a neighbour on its GPUs had been charged."""

    def attempt_ended(self, attempt: Attempt) -> None:
        """An attempt that just ended: charge it (and its GPU neighbours)."""

    def runs_changed(
        self, gpu_ids: list[int], since: datetime, until: datetime
    ) -> None:
        """A late report moved a run's start or end within [since, until): charge
        again what overlaps it on ``gpu_ids`` and recompute the GPU hours from
        ``since``."""

    def samples_changed(self, since: datetime, now: datetime) -> None:
        """GPU samples from ``since`` on were stored late (a replay after a
        disconnect): the GPU hours' idle time from ``since`` is recomputed."""


class Notifier(Protocol):
    """What a job's owner is told (``portal.notifications.services``)."""

    def job_started(self, job: Job, message: str) -> None:
        """The job started running."""

    def job_changed(self, job: Job, message: str) -> None:
        """The job's status changed (ends and failures reach the owner)."""

    def jobs_changed(self, jobs: Sequence[Job], summary: str) -> None:
        """Many jobs moved to one status at once (``transition_many``: an
        array's waiting tasks cancelled): one notice per owner, ``summary``
        saying what happened to how many, not one per job."""

    def job_preempted(self, job: Job, attempt: Attempt, message: str) -> None:
        """The job was preempted and is back in the queue; ``attempt`` is the one
        stopped (the work it lost, the job it yielded to)."""


class RunningUsage(Protocol):
    """The running attempts' GPU time so far, by the charging rule their usage
    records will follow when they end (``portal.accounting.live.LiveCharges``)."""

    def seconds(self, since: datetime | None = None) -> dict[int, float]:
        """GPU-seconds of each running attempt (by id), from ``since`` (None: its
        start) to the time the usage was loaded."""


class Usage(Protocol):
    """Provider of running usage (``portal.accounting``)."""

    def running(self, now: datetime) -> RunningUsage:
        """The running attempts' usage as of ``now`` (one query)."""


class QuotaState(Protocol):
    """One quota in its current period, as the pass reads it."""

    def view(self) -> QuotaView:
        """What the policy needs of it."""


class Quotas(Protocol):
    """Provider of quota states and handler of their alerts (``portal.quotas``)."""

    def states(self, now: datetime, usage: RunningUsage) -> Sequence[QuotaState]:
        """Every quota's state at ``now``; ``usage`` is the running usage the
        pass loaded at ``now`` (from ``usage().running``), counted again by
        nobody."""

    def pass_applied(self, states: Sequence[QuotaState]) -> int:
        """A pass applied its decisions; ``states`` are those it read (from
        ``states``): record the alerts now due, return how many."""


_accounting: Accounting | None = None
_notifier: Notifier | None = None
_usage: Usage | None = None
_quotas: Quotas | None = None


def register_accounting(handler: Accounting) -> None:
    """Install the accounting handler (``AccountingConfig.ready``)."""
    global _accounting
    _accounting = handler


def register_notifier(handler: Notifier) -> None:
    """Install the notification handler (``NotificationsConfig.ready``)."""
    global _notifier
    _notifier = handler


def register_usage(provider: Usage) -> None:
    """Install the running-usage provider (``AccountingConfig.ready``)."""
    global _usage
    _usage = provider


def register_quotas(provider: Quotas) -> None:
    """Install the quota provider and alert handler (``QuotasConfig.ready``)."""
    global _quotas
    _quotas = provider


def accounting() -> Accounting:
    if _accounting is None:
        raise HookMissing(
            "no accounting handler registered: is 'portal.accounting' in "
            "INSTALLED_APPS?"
        )
    return _accounting


def notifier() -> Notifier:
    if _notifier is None:
        raise HookMissing(
            "no notification handler registered: is 'portal.notifications' in "
            "INSTALLED_APPS?"
        )
    return _notifier


def usage() -> Usage:
    if _usage is None:
        raise HookMissing(
            "no running-usage provider registered: is 'portal.accounting' in "
            "INSTALLED_APPS?"
        )
    return _usage


def quotas() -> Quotas:
    if _quotas is None:
        raise HookMissing(
            "no quota provider registered: is 'portal.quotas' in INSTALLED_APPS?"
        )
    return _quotas
