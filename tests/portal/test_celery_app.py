"""``celery -A portal worker`` / ``beat`` (``make up``, docker-compose, the e2e
Stack) must find the Celery app and every task, although ``portal/__init__.py``
no longer imports ``portal.celery`` (so that ``portal.cli`` stays free of
Django). Checked in a fresh interpreter, as the ``celery`` command starts:
this test process has already loaded the app through ``PortalConfig.ready``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from django.conf import settings

# What ``celery -A portal`` does (celery.app.utils.find_app), then the worker's
# and beat's import of the task modules.
_PROBE = """
import json
from celery.app.utils import find_app
app = find_app("portal")
app.loader.import_default_modules()
print(json.dumps({"main": app.main, "tasks": sorted(app.tasks),
                  "beat": {k: v["task"] for k, v in app.conf.beat_schedule.items()},
                  "routes": list(app.conf.task_routes or [])}))
"""


def test_celery_dash_a_portal_finds_the_app_its_tasks_and_its_schedule() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["main"] == "portal"
    tasks = set(found["tasks"])
    assert {
        "scheduler.tasks.schedule_pass",
        "scheduler.tasks.check_nodes",
        "portal.notifications.tasks.deliver",
        "portal.notifications.tasks.sweep",
        "portal.idle.tasks.check_idle",
    } <= tasks
    # every periodic trigger names a task the worker knows
    assert found["beat"] == {
        name: entry["task"] for name, entry in settings.CELERY_BEAT_SCHEDULE.items()
    }
    assert set(found["beat"].values()) <= tasks
    assert found["routes"] == list(settings.CELERY_TASK_ROUTES)
