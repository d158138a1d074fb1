"""What the scheduler tells the portal apps above it, through an explicit registry.

``scheduler`` never imports ``portal`` (an import-linter contract, ``make lint``).
The apps that charge GPU time (``portal.accounting``) and tell owners about their
jobs (``portal.notifications``) hear about job events here: each registers its
handlers in its ``AppConfig.ready()`` with ``register_accounting`` /
``register_notifier``. The services call the module's functions, inside the
transaction that made the change, exactly where they used to call the apps.

No signals: every caller names the event it reports, every handler is registered in
one place, and an event with no handler raises ``HookMissing`` naming the app that
should have registered it (a configuration without that app is a broken one, never
a silent one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from datetime import datetime

    from scheduler.models import Attempt, Job


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


class Notifier(Protocol):
    """What a job's owner is told (``portal.notifications.services``)."""

    def job_started(self, job: Job, message: str) -> None:
        """The job started running."""

    def job_changed(self, job: Job, message: str) -> None:
        """The job's status changed (ends and failures reach the owner)."""


_accounting: Accounting | None = None
_notifier: Notifier | None = None


def register_accounting(handler: Accounting) -> None:
    """Install the accounting handler (``AccountingConfig.ready``)."""
    global _accounting
    _accounting = handler


def register_notifier(handler: Notifier) -> None:
    """Install the notification handler (``NotificationsConfig.ready``)."""
    global _notifier
    _notifier = handler


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
