"""The registry between scheduler and the portal apps (``scheduler.hooks``), and
the pass request the services make without importing ``scheduler.tasks``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, cast

import pytest
from celery import current_app
from django.utils import timezone

from portal.accounting.live import LiveCharges
from portal.accounting.live import Provider as UsageProvider
from portal.accounting.services import Handlers as AccountingHandlers
from portal.quotas.usage import Provider as QuotasProvider
from scheduler import hooks, pass_requests, tasks
from scheduler.services.common import request_pass


def test_each_portal_app_registered_its_handlers_and_providers() -> None:
    assert isinstance(hooks.accounting(), AccountingHandlers)
    assert isinstance(hooks.usage(), UsageProvider)
    assert isinstance(hooks.quotas(), QuotasProvider)


@pytest.mark.parametrize(
    ("slot", "call", "app"),
    [
        ("_usage", hooks.usage, "portal.accounting"),
        ("_quotas", hooks.quotas, "portal.quotas"),
        ("_accounting", hooks.accounting, "portal.accounting"),
        ("_notifier", hooks.notifier, "portal.notifications"),
    ],
)
def test_an_unregistered_hook_names_the_app_that_should_register_it(
    monkeypatch: pytest.MonkeyPatch, slot: str, call: Any, app: str
) -> None:
    monkeypatch.setattr(hooks, slot, None)

    with pytest.raises(hooks.HookMissing, match=f"'{app}' in INSTALLED_APPS"):
        call()


def test_the_quota_provider_refuses_usage_it_did_not_get_from_accounting() -> None:
    class Other:
        def seconds(self, since: Any = None) -> dict[int, float]:
            return {}

    with pytest.raises(TypeError, match="LiveCharges"):
        hooks.quotas().states(timezone.now(), Other())


def test_the_usage_provider_gives_the_charging_rules_live_charges(db: None) -> None:
    usage = hooks.usage().running(timezone.now())

    assert isinstance(usage, LiveCharges)
    assert usage.seconds() == {}


def _queue_key() -> str:
    conf = current_app.conf
    prefix = conf.broker_transport_options["global_keyprefix"]
    return f"{prefix}{conf.task_default_queue}"


def test_a_pass_request_enqueues_the_pass_task_once_on_the_real_broker() -> None:
    client = pass_requests._redis_client()
    client.delete(_queue_key(), pass_requests._queued_key())

    request_pass()
    request_pass()  # a pass is queued and not yet begun: nothing more to enqueue

    messages = cast("list[bytes]", client.lrange(_queue_key(), 0, -1))
    client.delete(_queue_key())
    assert len(messages) == 1
    assert json.loads(messages[0])["headers"]["task"] == tasks.schedule_pass.name
    assert pass_requests.schedule_pass.name == tasks.schedule_pass.name


def test_every_django_process_has_the_pass_task_registered() -> None:
    """The services enqueue the pass by name: a web process that never imported
    scheduler.tasks itself must know it (``SchedulerConfig.ready``)."""
    probe = (
        "import django; django.setup(); from celery import current_app;"
        " print('scheduler.tasks.schedule_pass' in current_app.tasks)"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings"}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
